{{- define "ember.name" -}}ember{{- end -}}

{{- define "ember.fullname" -}}
{{- if contains "ember" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-ember" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ember.labels" -}}
app.kubernetes.io/name: ember
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ember.selectorLabels" -}}
app.kubernetes.io/name: ember
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "ember.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ember.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ember.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Extra labels of a monitoring object: metrics.extraLabels, then its own (list $ .labels). */}}
{{- define "ember.monitorLabels" -}}
{{- $root := index . 0 -}}
{{- $all := merge (deepCopy (index . 1 | default dict)) (deepCopy ($root.Values.metrics.extraLabels | default dict)) -}}
{{- with $all }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* Namespaces where serving pods and SAVE Jobs run (a JSON list): workloadNamespaces plus the
operator's watched namespaces (pods are created only where their ModelDeployment is). */}}
{{- define "ember.workloadNamespaces" -}}
{{- concat (.Values.workloadNamespaces | default list) (.Values.operator.namespaces | default list) | uniq | toJson -}}
{{- end -}}
