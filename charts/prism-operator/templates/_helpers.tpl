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

{{/* The operator's own identity, as the API server names it in admission requests. */}}
{{- define "prism.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "prism.fullname" . }}
{{- end -}}

{{/* "true" when the chart installs the ValidatingAdmissionPolicy that guards the owner
annotation of ControllerRegistrations: only then does the operator trust it. */}}
{{- define "prism.ownerPolicy" -}}
{{- if and .Values.admissionPolicy.enabled (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") -}}true{{- end -}}
{{- end -}}
