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
