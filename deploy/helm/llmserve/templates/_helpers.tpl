{{/* Labels every object carries; `component` tells router and replica apart. */}}
{{- define "llmserve.labels" -}}
app.kubernetes.io/name: llmserve
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
{{- end }}

{{- define "llmserve.selector" -}}
app.kubernetes.io/name: llmserve
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
The pod's grace period: the preStop sleep, then the services' own drain
(--shutdown-timeout), then a margin (the worker keeps stepping until its scheduler has
drained, and the servers close). Past it the kubelet sends SIGKILL.
*/}}
{{- define "llmserve.gracePeriod" -}}
{{ add .Values.preStopSleepSeconds .Values.shutdownTimeoutSeconds .Values.graceMarginSeconds }}
{{- end }}

{{/*
grpc probes on the plaintext --health-port: startup (model load, registration), then
readiness and liveness. `service` names the grpc.health.v1 service readiness asks about.
*/}}
{{- define "llmserve.probes" -}}
startupProbe:
  grpc: {port: {{ .port }}, service: ""}
  periodSeconds: 10
  failureThreshold: {{ div .startupSeconds 10 }}
readinessProbe:
  grpc: {port: {{ .port }}, service: {{ .readiness | quote }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .port }}, service: ""}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
lifecycle:
  preStop:
    sleep: {seconds: {{ .preStopSleep }}}
{{- end }}

{{/* Environment every service container gets: its role's files from the Secret, the drain time. */}}
{{- define "llmserve.tlsEnv" -}}
- {name: LLMSERVE_TLS_CERT, value: /opt/llmserve/certs/{{ .role }}.crt}
- {name: LLMSERVE_TLS_KEY, value: /opt/llmserve/certs/{{ .role }}.key}
- {name: LLMSERVE_TLS_CA, value: /opt/llmserve/certs/ca.crt}
- {name: LLMSERVE_SHUTDOWN_TIMEOUT, value: {{ .root.Values.shutdownTimeoutSeconds | quote }}}
- {name: LLMSERVE_LOG_LEVEL, value: INFO}
{{- end }}

{{/* A volume of the Secret with only this role's files (and the CA; the router: the API keys). */}}
{{- define "llmserve.tlsVolume" -}}
- name: certs-{{ .role }}
  secret:
    secretName: {{ .root.Values.tlsSecret }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: {{ .role }}.crt, path: {{ .role }}.crt}
      - {key: {{ .role }}.key, path: {{ .role }}.key}
      {{- if eq .role "router" }}
      - {key: api-key, path: api-key}
      {{- end }}
{{- end }}
