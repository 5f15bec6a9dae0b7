{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "fenceproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "fenceproxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fenceproxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fenceproxy.labels" -}}
helm.sh/chart: {{ include "fenceproxy.chart" . }}
{{ include "fenceproxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fenceproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fenceproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fenceproxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fenceproxy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fenceproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The configuration file: .Values.config with the listeners set from .Values.ports. */}}
{{- define "fenceproxy.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int .Values.ports.postgres)) }}
{{- $admin := deepCopy (default dict $cfg.admin) }}
{{- $_ := set $admin "listen" (printf "0.0.0.0:%d" (int .Values.ports.admin)) }}
{{- $_ := set $cfg "admin" $admin }}
{{- toYaml $cfg }}
{{- end }}

{{/* The audit password variable, when a Secret is named. */}}
{{- define "fenceproxy.env" -}}
{{- if .Values.auditPassword.existingSecret }}
- name: FENCEPROXY_AUDIT_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auditPassword.existingSecret }}
      key: {{ .Values.auditPassword.key }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The args of fenceproxy setup. */}}
{{- define "fenceproxy.setupArgs" -}}
["setup", "--config", "/etc/fenceproxy/fenceproxy.yaml"{{ if .Values.setup.addColumns }}, "--add-columns"{{ end }}{{ if .Values.setup.guard }}, "--guard"{{ end }}]
{{- end }}

{{/* The proxy pods (not the setup Job's). */}}
{{- define "fenceproxy.proxySelectorLabels" -}}
{{ include "fenceproxy.selectorLabels" . }}
app.kubernetes.io/component: proxy
{{- end }}
