{{/* The release's name for this chart's objects (at most 63 characters). */}}
{{- define "dpumesh-node.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dpumesh-node.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dpumesh-node.labels" -}}
{{ include "dpumesh-node.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: dpu-proxy
app.kubernetes.io/part-of: dpumesh
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dpumesh-node.configMap" -}}
{{- default (printf "%s-config" (include "dpumesh-node.fullname" .)) .Values.mesh.existingConfigMap -}}
{{- end -}}
