{{/*
Labels of every object: the same four that `gpupool render` (spawner/volcano.py: labels) writes, so the
objects the chart makes itself carry the labels of those it emits pre-rendered.
Call with (dict "context" $ "component" "accounting").
*/}}
{{- define "gpupool.labels" -}}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/name: gpupool
app.kubernetes.io/part-of: gpupool
{{- end }}

{{- define "gpupool.selector" -}}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/name: gpupool
{{- end }}

{{/*
The values must come from `gpupool render --helm-values` for this release, and the policy files in them
must be the ones the objects were rendered from: the digest is recomputed here the way
spawner/volcano.py: policies_digest computes it (map keys in sorted order, "name\ntext\n" each).
*/}}
{{- define "gpupool.checks" -}}
{{- $g := .Values.gpupool -}}
{{- if not $g.policies -}}
{{- fail "gpupool.policies is empty: make the values from your policy directory with `gpupool render --policies DIR --release RELEASE --helm-values > gpupool-values.yaml` and install with -f gpupool-values.yaml" -}}
{{- end -}}
{{- if ne $g.release .Release.Name -}}
{{- fail (printf "gpupool.release: these values were rendered for release %q, this release is %q: run `gpupool render --release %s --helm-values` again" $g.release .Release.Name .Release.Name) -}}
{{- end -}}
{{- $text := "" -}}
{{- range $name, $content := $g.policies -}}
{{- $text = printf "%s%s\n%s\n" $text $name $content -}}
{{- end -}}
{{- if ne (printf "sha256:%s" (sha256sum $text)) $g.policiesDigest -}}
{{- fail "gpupool.policies differ from the files the objects were rendered from (gpupool.policiesDigest): change the policy files and run `gpupool render --helm-values` again instead of editing the values" -}}
{{- end -}}
{{- end }}

{{/* PostgreSQL: a host and a Secret holding the password are required; no password is ever a value. */}}
{{- define "gpupool.postgresql.check" -}}
{{- $pg := .Values.postgresql -}}
{{- if not $pg.host -}}
{{- fail "postgresql.host: the accounting ledger needs a PostgreSQL server; give its host name" -}}
{{- end -}}
{{- if not $pg.existingSecret -}}
{{- fail "postgresql.existingSecret: name the Secret holding the PostgreSQL password (under key postgresql.passwordKey); the chart takes no password in values" -}}
{{- end -}}
{{- end }}

{{/* A libpq URL without the password (libpq reads it from PGPASSWORD). Call with (dict "context" $ "database" "x" "driver" "postgresql+psycopg"). */}}
{{- define "gpupool.postgresql.url" -}}
{{- $pg := .context.Values.postgresql -}}
{{- printf "%s://%s@%s:%d/%s" .driver $pg.user $pg.host (int $pg.port) .database -}}
{{- if $pg.sslmode }}{{ printf "?sslmode=%s" $pg.sslmode }}{{ end -}}
{{- end }}

{{- define "gpupool.postgresql.passwordEnv" -}}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgresql.existingSecret | quote }}
      key: {{ .Values.postgresql.passwordKey | quote }}
{{- end }}

{{- define "gpupool.image" -}}
{{- printf "%s:%s" .image.name (.image.tag | default .context.Chart.AppVersion) -}}
{{- end }}

{{/* The hub writes the ledger too: its PostgreSQL password must reach it (z2jh's hub.extraEnv), from the same Secret. */}}
{{- define "gpupool.hub.passwordCheck" -}}
{{- $pg := .Values.postgresql -}}
{{- $env := ((.Values.jupyterhub).hub).extraEnv | default dict -}}
{{- $ref := (($env.PGPASSWORD | default dict).valueFrom | default dict).secretKeyRef | default dict -}}
{{- if not (and (eq ($ref.name | toString) ($pg.existingSecret | toString)) (eq ($ref.key | toString) ($pg.passwordKey | toString))) -}}
{{- fail (printf "jupyterhub.hub.extraEnv.PGPASSWORD: the hub records usage in the ledger and needs the PostgreSQL password from the same Secret as the accounting service; add to your values:\n  jupyterhub:\n    hub:\n      extraEnv:\n        PGPASSWORD:\n          valueFrom:\n            secretKeyRef: {name: %s, key: %s}" $pg.existingSecret $pg.passwordKey) -}}
{{- end -}}
{{- end }}

{{/*
A gpupool hub service that the chart runs beside the hub (the accounting service, the idle culler): one pod and
its Service, registered in the hub by `gpupool render --helm-values` (jupyterhub.hub.services.<service>). The pod
reads the policies and the ledger and is a JupyterHub service (HubOAuth for users, its own token for the hub's
API): the token is z2jh's `hub.services.<service>.apiToken` in the hub Secret. The hub's address and Secret are
accounting.hubApiUrl and accounting.hubSecretName for every such service (MLflow's too).
Call with (dict "context" $ "component" "culler" "service" "culler" "port" 8080 "settings" .Values.culler
"args" (list "--x") "env" (list (dict "name" "X" "value" "x")) "recreate" true); args, env and recreate (a
Deployment that never runs two pods, even during an upgrade) are optional.
*/}}
{{- define "gpupool.hubService" -}}
{{- $c := .context -}}
{{- $s := .settings -}}
{{- $component := .component -}}
{{- $service := .service -}}
{{- $port := int .port -}}
{{- $prefix := printf "/services/%s/" $service -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $c.Release.Name }}-{{ $component }}
  namespace: {{ $c.Release.Namespace }}
  labels:
    {{- include "gpupool.labels" (dict "context" $c "component" $component) | nindent 4 }}
spec:
  replicas: 1
  {{- if .recreate }}
  # One at a time, also during an upgrade: two would look at the same servers and count idle time twice.
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "gpupool.selector" (dict "context" $c "component" $component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "gpupool.labels" (dict "context" $c "component" $component) | nindent 8 }}
        # Zero-to-JupyterHub's NetworkPolicy lets only pods with this label reach the hub's API.
        hub.jupyter.org/network-access-hub: "true"
      annotations:
        # The service reads the policies (prices, budgets, idle rules): new policy files, new pods.
        gpupool.io/policies-digest: {{ $c.Values.gpupool.policiesDigest | quote }}
    spec:
      # The service talks to the hub, not to the Kubernetes API.
      automountServiceAccountToken: false
      {{- with $s.imagePullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . | quote }}
        {{- end }}
      {{- end }}
      securityContext:
        {{- toYaml $s.podSecurityContext | nindent 8 }}
      containers:
        - name: {{ $component }}
          image: {{ include "gpupool.image" (dict "context" $c "image" $s.image) | quote }}
          imagePullPolicy: {{ $s.image.pullPolicy }}
          command:
            {{- toYaml $s.command | nindent 12 }}
          {{- with .args }}
          args:
            {{- range . }}
            - {{ . | quote }}
            {{- end }}
          {{- end }}
          ports:
            - name: http
              containerPort: {{ $port }}
          env:
            - name: GPUPOOL_POLICIES
              value: {{ $c.Values.gpupool.policyDir | quote }}
            - name: GPUPOOL_LEDGER_URL
              value: {{ include "gpupool.postgresql.url" (dict "context" $c "driver" "postgresql+psycopg" "database" $c.Values.postgresql.database) | quote }}
            {{- include "gpupool.postgresql.passwordEnv" $c | nindent 12 }}
            # What a JupyterHub service needs to authenticate users and call the hub (HubOAuth, HubAuth).
            - name: JUPYTERHUB_SERVICE_NAME
              value: {{ $service | quote }}
            - name: JUPYTERHUB_SERVICE_PREFIX
              value: {{ $prefix | quote }}
            # Where the service listens: on the pod's addresses, reached by the hub's proxy through the Service.
            - name: JUPYTERHUB_SERVICE_URL
              value: {{ printf "http://0.0.0.0:%d" $port | quote }}
            - name: JUPYTERHUB_API_URL
              value: {{ $c.Values.accounting.hubApiUrl | quote }}
            - name: JUPYTERHUB_API_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $c.Values.accounting.hubSecretName | quote }}
                  key: {{ printf "hub.services.%s.apiToken" $service | quote }}
            - name: JUPYTERHUB_CLIENT_ID
              value: {{ printf "service-%s" $service | quote }}
            - name: JUPYTERHUB_OAUTH_CALLBACK_URL
              value: {{ printf "%soauth_callback" $prefix | quote }}
            {{- range .env }}
            - name: {{ .name | quote }}
              value: {{ .value | quote }}
            {{- end }}
            {{- range $name, $value := $s.extraEnv }}
            - name: {{ $name | quote }}
              value: {{ $value | quote }}
            {{- end }}
          readinessProbe:
            tcpSocket:
              port: http
            periodSeconds: 10
          livenessProbe:
            tcpSocket:
              port: http
            initialDelaySeconds: 30
            periodSeconds: 30
          {{- with $s.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $s.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - name: policies
              mountPath: {{ $c.Values.gpupool.policyDir | quote }}
              readOnly: true
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: policies
          configMap:
            name: {{ $c.Release.Name }}-policies
        # The root filesystem is read-only.
        - name: tmp
          emptyDir: {}
      {{- with $s.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $c.Release.Name }}-{{ $component }}
  namespace: {{ $c.Release.Namespace }}
  labels:
    {{- include "gpupool.labels" (dict "context" $c "component" $component) | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "gpupool.selector" (dict "context" $c "component" $component) | nindent 4 }}
  ports:
    - name: http
      port: {{ $port }}
      targetPort: http
{{- end }}
