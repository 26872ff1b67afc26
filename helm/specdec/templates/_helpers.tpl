{{/*
Helpers shared by all templates. Most take a "component context":
  dict "root" $ "component" "<gateway | scorer | proposer-<method>>" "values" <that component's values>
plus, for specdec.deployment: "container", "args", "gpu", "mountModel" and
"serviceAccountName" (see there).
*/}}

{{/* The chart name (labels). */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<release>-<chart>" or fullnameOverride, untruncated: only specdec.resourceName may use it. */}}
{{- define "specdec.baseName" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else -}}
{{- $name := include "specdec.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
THE name of every resource: "<base>-<component>", at most 63 characters.
The base is truncated, never the component, so components stay distinct
however long the release name is.
  include "specdec.resourceName" (dict "root" $ "component" "scorer")
*/}}
{{- define "specdec.resourceName" -}}
{{- $base := include "specdec.baseName" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base .component -}}
{{- end -}}

{{/* The component name of a proposer method's Deployment, Service, HPA and PDB. */}}
{{- define "specdec.proposerComponent" -}}
{{- printf "proposer-%s" . -}}
{{- end -}}

{{/* The gateway's ServiceAccount (the one the Role is bound to). */}}
{{- define "specdec.gatewayServiceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specdec.resourceName" (dict "root" . "component" "gateway")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels that select a component's pods. */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every resource of a component. */}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end -}}

{{/* Whether a component context gets a GPU: it asks for one ("gpu") and gpu.enabled. */}}
{{- define "specdec.usesGpu" -}}
{{- if and .root.Values.gpu.enabled .gpu -}}true{{- end -}}
{{- end -}}

{{/* The pinned image: "<repository>:<tag or appVersion>-<cpu|cuda>". */}}
{{- define "specdec.image" -}}
{{- $image := .root.Values.image -}}
{{- $variant := ternary "cuda" "cpu" (eq (include "specdec.usesGpu" .) "true") -}}
{{- printf "%s:%s-%s" $image.repository (default .root.Chart.AppVersion $image.tag) $variant -}}
{{- end -}}

{{/*
THE probe helper: gRPC liveness and readiness probes (and a startup probe
when probes.startup.enabled) on the standard grpc.health.v1 service. No
`service` is set, so the kubelet asks for "", the server's overall health.
  include "specdec.grpcProbes" (dict "port" 50051 "probes" .values.probes)
*/}}
{{- define "specdec.grpcProbes" -}}
{{- $port := int .port -}}
{{- range $kind := list "liveness" "readiness" "startup" }}
{{- $timing := index $.probes $kind }}
{{- if or (ne $kind "startup") $timing.enabled }}
{{ $kind }}Probe:
  grpc:
    port: {{ $port }}
  {{- range $key, $value := omit $timing "enabled" }}
  {{ $key }}: {{ int $value }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Probes for a component: gRPC probes on the standard health service, or,
with tls.enabled (the kubelet's gRPC probe cannot speak TLS), the same check
run as `specdec health` inside the container over mutual TLS.
  include "specdec.probes" (dict "root" $ "port" 50051 "probes" .values.probes)
*/}}
{{- define "specdec.probes" -}}
{{- $tls := .root.Values.tls -}}
{{- if not $tls.enabled -}}
{{- include "specdec.grpcProbes" (dict "port" .port "probes" .probes) -}}
{{- else -}}
{{- $d := $tls.mountPath -}}
{{- $command := list "specdec" "health" "--addr" (printf "127.0.0.1:%d" (int .port))
      "--tls-ca" (printf "%s/ca.crt" $d) "--tls-client-cert" (printf "%s/tls.crt" $d)
      "--tls-client-key" (printf "%s/tls.key" $d) "--tls-server-name" $tls.serverName -}}
{{- range $kind := list "liveness" "readiness" "startup" }}
{{- $timing := index $.probes $kind }}
{{- if or (ne $kind "startup") $timing.enabled }}
{{ $kind }}Probe:
  exec:
    command: {{ toJson $command }}
  {{- range $key, $value := omit $timing "enabled" }}
  {{ $key }}: {{ int $value }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
The security flags of a component (a JSON list): with tls.enabled every
service serves the Secret's certificate; scorer and proposers require a
client certificate from its CA, the gateway presents one and verifies them
against tls.serverName. With apiKeys.enabled the gateway reads keys from the
mounted Secret.
*/}}
{{- define "specdec.securityArgs" -}}
{{- $tls := .root.Values.tls -}}
{{- $keys := .root.Values.apiKeys -}}
{{- $gateway := eq .component "gateway" -}}
{{- $args := list -}}
{{- if $tls.enabled -}}
{{- $_ := required "tls.enabled needs tls.secretName: a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt" $tls.secretName -}}
{{- $_ := required "tls.enabled needs tls.serverName: the DNS name in the certificate that clients verify (pods are dialled by IP)" $tls.serverName -}}
{{- $d := $tls.mountPath -}}
{{- $args = list "--tls-cert" (printf "%s/tls.crt" $d) "--tls-key" (printf "%s/tls.key" $d) -}}
{{- if $gateway -}}
{{- $args = concat $args (list "--upstream-tls-ca" (printf "%s/ca.crt" $d)
      "--tls-client-cert" (printf "%s/tls.crt" $d) "--tls-client-key" (printf "%s/tls.key" $d)
      "--upstream-tls-server-name" $tls.serverName) -}}
{{- else -}}
{{- $args = concat $args (list "--tls-client-ca" (printf "%s/ca.crt" $d)) -}}
{{- end -}}
{{- end -}}
{{- if and $gateway $keys.enabled -}}
{{- $_ := required "apiKeys.enabled needs apiKeys.secretName: a Secret with one key per line" $keys.secretName -}}
{{- $args = concat $args (list "--api-keys" (printf "%s/%s" $keys.mountPath $keys.key)) -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{/* A component's resources, plus the GPU limit when it gets a GPU. */}}
{{- define "specdec.resources" -}}
{{- $resources := deepCopy (default (dict) .values.resources) -}}
{{- if eq (include "specdec.usesGpu" .) "true" -}}
{{- $limits := default (dict) $resources.limits -}}
{{- $_ := set $limits .root.Values.gpu.resourceName (int .root.Values.gpu.count) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/*
A component's Deployment. Context keys besides root/component/values:
  container           the container name
  args                the specdec sub-command and its flags (strings); values.extraArgs follow
  gpu                 true for model runners (scorer, draft proposer): GPU and "-cuda" image when gpu.enabled
  mountModel          mount the model volume and the Hugging Face cache, set HF_HOME,
                      SPECDEC_GGUF_CACHE_DIR (dequantised GGUF copies),
                      SPECDEC_TOKENIZER_CACHE_DIR (tokenizer classes) and
                      SPECDEC_CHECKPOINT_CACHE_DIR (records of checkpoint loads) into it
  serviceAccountName  set for pods that call the Kubernetes API; others get no token
*/}}
{{- define "specdec.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $usesGpu := eq (include "specdec.usesGpu" .) "true" -}}
{{- $isGateway := eq .component "gateway" -}}
{{- $podLabels := mergeOverwrite (deepCopy (default (dict) $v.podLabels)) (include "specdec.labels" . | fromYaml) -}}
{{- $env := list -}}
{{- if .mountModel -}}
{{- $env = append $env (dict "name" "HF_HOME" "value" (printf "%s/huggingface" $root.Values.model.cache.mountPath)) -}}
{{- $env = append $env (dict "name" "SPECDEC_GGUF_CACHE_DIR" "value" (printf "%s/specdec-gguf" $root.Values.model.cache.mountPath)) -}}
{{- $env = append $env (dict "name" "SPECDEC_TOKENIZER_CACHE_DIR" "value" (printf "%s/specdec-tokenizers" $root.Values.model.cache.mountPath)) -}}
{{- $env = append $env (dict "name" "SPECDEC_CHECKPOINT_CACHE_DIR" "value" (printf "%s/specdec-checkpoints" $root.Values.model.cache.mountPath)) -}}
{{- end -}}
{{- $env = concat $env $v.extraEnv -}}
{{- $nodeSelector := deepCopy (default (dict) $v.nodeSelector) -}}
{{- $tolerations := default (list) $v.tolerations -}}
{{- if $usesGpu -}}
{{- $nodeSelector = merge $nodeSelector $root.Values.gpu.nodeSelector -}}
{{- $tolerations = concat $tolerations $root.Values.gpu.tolerations -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.resourceName" . }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ int $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- toYaml $podLabels | nindent 8 }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- if .serviceAccountName }}
      serviceAccountName: {{ .serviceAccountName }}
      {{- else }}
      automountServiceAccountToken: false
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ int $v.terminationGracePeriodSeconds }}
      containers:
        - name: {{ .container }}
          image: {{ include "specdec.image" . | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- toYaml (concat .args (include "specdec.securityArgs" . | fromJsonArray) $v.extraArgs) | nindent 12 }}
          {{- with $env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - name: grpc
              containerPort: {{ int $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ int $root.Values.metrics.port }}
              protocol: TCP
            {{- if $v.httpPort }}
            - name: http
              containerPort: {{ int $v.httpPort }}
              protocol: TCP
            {{- end }}
          {{- include "specdec.probes" (dict "root" $root "port" $v.port "probes" $v.probes) | trim | nindent 10 }}
          resources:
            {{- include "specdec.resources" . | nindent 12 }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp  # JIT caches (numba, Triton) with a read-only root filesystem
              mountPath: /tmp
            {{- if .mountModel }}
            - name: hf-cache
              mountPath: {{ $root.Values.model.cache.mountPath }}
            {{- if $root.Values.model.volume.enabled }}
            - name: model
              mountPath: {{ $root.Values.model.volume.mountPath }}
              readOnly: true
            {{- end }}
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: {{ $root.Values.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and $isGateway $root.Values.apiKeys.enabled }}
            - name: api-keys  # the whole Secret (not subPath), so key changes reach the file
              mountPath: {{ $root.Values.apiKeys.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if .mountModel }}
        - name: hf-cache
          {{- toYaml (default (dict "emptyDir" (dict)) $root.Values.model.cache.source) | nindent 10 }}
        {{- if $root.Values.model.volume.enabled }}
        - name: model
          {{- toYaml $root.Values.model.volume.source | nindent 10 }}
        {{- end }}
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ $root.Values.tls.secretName }}
            defaultMode: 0440
        {{- end }}
        {{- if and $isGateway $root.Values.apiKeys.enabled }}
        - name: api-keys
          secret:
            secretName: {{ $root.Values.apiKeys.secretName }}
            defaultMode: 0440
        {{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/*
A component's Service: the named port "grpc" (what the gateway's
EndpointSlice discovery and clients use) and "metrics". Headless services
(clusterIP: None) resolve to the pods themselves.
*/}}
{{- define "specdec.service" -}}
{{- $v := .values -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.resourceName" . }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $v.service.type }}
  {{- if $v.service.headless }}
  clusterIP: None
  {{- end }}
  selector:
    {{- include "specdec.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ int $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ int .root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- if $v.httpPort }}
    - name: http
      port: {{ int $v.httpPort }}
      targetPort: http
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end -}}

{{/* A component's HorizontalPodAutoscaler (autoscaling/v2) over its Deployment. */}}
{{- define "specdec.hpa" -}}
{{- $a := .values.autoscaling -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "%s: autoscaling.minReplicas (%d) is above maxReplicas (%d)" .component (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- if not (or $a.targetCPUUtilizationPercentage $a.targetMemoryUtilizationPercentage) -}}
{{- fail (printf "%s: autoscaling needs targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage" .component) -}}
{{- end -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specdec.resourceName" . }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.resourceName" . }}
  minReplicas: {{ int $a.minReplicas }}
  maxReplicas: {{ int $a.maxReplicas }}
  metrics:
    {{- range $resource, $target := dict "cpu" $a.targetCPUUtilizationPercentage "memory" $a.targetMemoryUtilizationPercentage }}
    {{- if $target }}
    - type: Resource
      resource:
        name: {{ $resource }}
        target:
          type: Utilization
          averageUtilization: {{ int $target }}
    {{- end }}
    {{- end }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A component's PodDisruptionBudget: minAvailable when set, else maxUnavailable (default 1). */}}
{{- define "specdec.pdb" -}}
{{- $p := .values.pdb -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.resourceName" . }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  {{- if not (kindIs "invalid" $p.minAvailable) }}
  minAvailable: {{ $p.minAvailable | toYaml }}
  {{- else if not (kindIs "invalid" $p.maxUnavailable) }}
  maxUnavailable: {{ $p.maxUnavailable | toYaml }}
  {{- else }}
  maxUnavailable: 1
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
{{- end -}}
