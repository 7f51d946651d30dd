{{- define "prism.name" -}}prism-operator{{- end -}}

{{- define "prism.fullname" -}}
{{- if contains "prism-operator" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-prism-operator" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "prism.labels" -}}
app.kubernetes.io/name: prism-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "prism.selector" -}}
app.kubernetes.io/name: prism-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "prism.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}
