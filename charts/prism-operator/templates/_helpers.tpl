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

{{- /* The Secret the API's certificate comes from: the user's, or the one the chart makes. */ -}}
{{- define "prism.tlsSecret" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "prism.fullname" .)) -}}
{{- end -}}

{{- /* The API port's name: https with TLS (so meshes and monitors do not take it for plain HTTP). */ -}}
{{- define "prism.portName" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end -}}
{{- end -}}

{{- /* RBAC rules on the custom resources and Events: cluster-wide, or in config.watchNamespace. */ -}}
{{- define "prism.resourceRules" }}
  # Watch and reconcile the custom resources. The agent API creates and deletes
  # registrations on behalf of callers it has authorized with a SubjectAccessReview;
  # RunSessions are only ever created by their owners (kubectl, GitOps).
  - apiGroups: ["prism.ntecdev.ai"]
    resources: ["controllerregistrations"]
    verbs: ["get", "list", "watch", "patch", "create", "delete"]
  - apiGroups: ["prism.ntecdev.ai"]
    resources: ["runsessions"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["prism.ntecdev.ai"]
    resources: ["controllerregistrations/status", "runsessions/status"]
    verbs: ["get", "patch"]
  - apiGroups: ["prism.ntecdev.ai"]
    resources: ["controllerregistrations/finalizers", "runsessions/finalizers"]
    verbs: ["update"]
  - apiGroups: ["events.k8s.io"]
    resources: ["events"]
    verbs: ["create", "patch"]
{{- end }}
