#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against, from the Go module proxy, pinned by
# kube/versions.env: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK (nodes and pod
# lifecycles without a kubelet). Output: $GPUPOOL_KUBE_CACHE/<versions>/bin (default ~/.cache/gpupool/kube),
# never inside the repository. Idempotent: a complete set is left alone.
# Then Volcano (vc-scheduler, vc-controller-manager) from its release archive in $GPUPOOL_UPSTREAM (default
# ../shared/upstream beside the repository; its name and sha256 in versions.env), unpacked and built in
# $GPUPOOL_KUBE_CACHE/volcano-<version>/ (src/: the unpacked tree, whose CRDs, admission policies and chart the
# tests read; bin/). An archive with another sha256 is refused; a missing one is said (with where it comes
# from) and skipped: the tests that need Volcano then skip, naming it.
# Then Apache YuniKorn's scheduler (issue 37), from its three release archives in the same folder, the same way,
# into $GPUPOOL_KUBE_CACHE/yunikorn-<version>/ (src/: the unpacked k8shim, core and scheduler interface; bin/).
# Its REST server's address is hard-coded in core (":9080", every interface): the unpacked core is patched here
# to listen on 127.0.0.1 only, on the port of $YUNIKORN_REST_PORT (9080 when unset), so that a test's scheduler
# is never open on the machine's interfaces and several can run side by side. A network namespace of its own
# (`unshare -n`) would also keep it off the interfaces, but the scheduler must reach the API server on this
# machine's loopback, which a new namespace does not have: the patch is the simpler of the two.
# KWOK is patched too (`kwok_patch`): its pod controller deletes and patches pods by name, where a kubelet names
# the pod's UID as a precondition; Volcano names a Job's pods alike on every restart, so a late delete of the
# last pod deleted the next one (seen in CI: a run Volcano restarted twice for one failure).
#
# `go install pkg@version` refuses modules with replace directives (Kubernetes' staging modules, etcd's
# sibling modules), so each is built from a small wrapper module that requires the release and replaces every
# sibling by its published version, derived from the release's own go.mod.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
cache="${GPUPOOL_KUBE_CACHE:-$HOME/.cache/gpupool/kube}"
dest="$cache/k8s-$KUBERNETES_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)
#: The KWOK binary's patch level (`kwok_patch` below); a binary built before it is built again.
kwok_patched="$dest/bin/.kwok-uid-preconditions"
# complete: every binary (KWOK's patched), KWOK's stages and its CRDs (copied last)
complete() {
  for b in "${bins[@]}"; do [[ -x "$dest/bin/$b" ]] || return 1; done
  [[ -f "$kwok_patched" && -f "$dest/kwok-stages/.complete" && -f "$dest/kwok-crds/.complete" ]]
}
vdest="$cache/volcano-$VOLCANO_VERSION"
vbins=(vc-scheduler vc-controller-manager)
upstream="${GPUPOOL_UPSTREAM:-$(cd "$here/../.." && pwd)/shared/upstream}"
varchive="$upstream/$VOLCANO_ARCHIVE"
volcano_complete() {
  for b in "${vbins[@]}"; do [[ -x "$vdest/bin/$b" ]] || return 1; done
  [[ -f "$vdest/src/.complete" ]]
}
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dest"; exit 0; fi
if [[ "${1:-}" == "--print-volcano-dir" ]]; then echo "$vdest"; exit 0; fi
ydest="$cache/yunikorn-$YUNIKORN_VERSION"
yunikorn_complete() { [[ -x "$ydest/bin/yunikorn-scheduler" && -f "$ydest/src/.complete" ]]; }
if [[ "${1:-}" == "--print-yunikorn-dir" ]]; then echo "$ydest"; exit 0; fi
if complete && volcano_complete && yunikorn_complete; then
  echo "kube-tools: up to date in $dest/bin, $vdest/bin and $ydest/bin"; exit 0
fi
command -v go >/dev/null || { echo "kube-tools: the Go toolchain is needed (go on PATH)"; exit 1; }

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
# The compiler's cache is needed only while the set builds (about 4 GB): kept beside it, removed once complete.
export GOCACHE="$cache/go-build"
work="$dest/src"
mkdir -p "$dest/bin" "$work"
start=$SECONDS
step() { printf 'kube-tools [%4ds] %s\n' $((SECONDS - start)) "$*"; }

# mod_file MODULE VERSION: the path of the release's go.mod in the module cache (downloading it).
mod_file() { go mod download -json "$1@$2" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p'; }
# wrapper DIR MODULE VERSION PREFIX SIBLING_VERSION: a module requiring MODULE@VERSION with every local replace
# of MODULE's go.mod under PREFIX pointed at PREFIX…@SIBLING_VERSION.
wrapper() {
  local dir="$1" module="$2" version="$3" prefix="$4" sibling="$5" gomod
  mkdir -p "$dir"
  gomod="$(cd "$dir" && mod_file "$module" "$version")"
  {
    echo "module gpupool.local/kubetools"
    echo "go 1.24"
    echo "require $module $version"
    grep -E "^\s*$prefix[^ ]* => \.\.?/" "$gomod" | awk -v v="$sibling" '{print "replace " $1 " => " $1 " " v}'
  } > "$dir/go.mod"
  # the stub main package makes `go mod tidy` keep everything the binaries import
}

build() { # DIR OUT PKG [LDFLAGS]
  local dir="$1" out="$2" pkg="$3" ldflags="${4:-}"
  step "building $out ($pkg)"
  (cd "$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$dest/bin/$out.tmp" "$pkg")
  mv "$dest/bin/$out.tmp" "$dest/bin/$out"
}

# kwok_patch DIR: KWOK's module copied into DIR/kwok-src and put in by a `replace` line, its pod controller
# patched to name the pod's UID when it deletes or patches a pod, as a kubelet does (Kubernetes' status manager:
# a UID precondition on its delete, `metadata.uid` in its status patch): the API server then refuses what was
# meant for an earlier pod of the same name. The build stops if the lines this patch knows changed.
kwok_patch() {
  local dir="$1" src controllers
  src="$(cd "$dir" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  rm -rf "$dir/kwok-src" && cp -r "$src" "$dir/kwok-src" && chmod -R u+w "$dir/kwok-src"
  controllers="$dir/kwok-src/pkg/kwok/controllers"
  for line in 'Pods(pod.Namespace).Delete(ctx, pod.Name, deleteOpt)' \
              'Pods(pod.Namespace).Patch(ctx, pod.Name, patch.Type, patch.Data, metav1.PatchOptions{}, subresource...)'; do
    grep -qF "$line" "$controllers/pod_controller.go" || {
      echo "kube-tools: KWOK's pod_controller.go no longer has \"$line\": the UID patch needs updating" >&2; exit 1; }
  done
  sed -i -e 's|Pods(pod.Namespace).Delete(ctx, pod.Name, deleteOpt)|Pods(pod.Namespace).Delete(ctx, pod.Name, podDeleteOptions(pod))|' \
         -e 's|Pods(pod.Namespace).Patch(ctx, pod.Name, patch.Type, patch.Data, |Pods(pod.Namespace).Patch(ctx, pod.Name, patch.Type, patchWithUID(patch, pod), |' \
         "$controllers/pod_controller.go"
  cat > "$controllers/gpupool_uid.go" <<'GO'
package controllers

// Patched in by gpupool's kube/build-tools.sh: KWOK acts on the pod it saw, as a kubelet does, never on a newer
// pod of the same name.

import (
	"encoding/json"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/kwok/pkg/utils/lifecycle"
)

// podDeleteOptions: KWOK's delete options with the pod's UID as a precondition.
func podDeleteOptions(pod *corev1.Pod) metav1.DeleteOptions {
	opt := *deleteOpt.DeepCopy()
	opt.Preconditions = metav1.NewUIDPreconditions(string(pod.UID))
	return opt
}

// patchWithUID: the patch with the pod's UID in it, which the API server refuses to change: `metadata.uid` in a
// merge patch, a `test` operation before a JSON patch.
func patchWithUID(patch *lifecycle.Patch, pod *corev1.Pod) []byte {
	if pod.UID == "" {
		return patch.Data
	}
	switch patch.Type {
	case types.MergePatchType, types.StrategicMergePatchType:
		var object map[string]any
		if json.Unmarshal(patch.Data, &object) != nil || object == nil {
			return patch.Data
		}
		meta, _ := object["metadata"].(map[string]any)
		if meta == nil {
			meta = map[string]any{}
		}
		meta["uid"] = string(pod.UID)
		object["metadata"] = meta
		if data, err := json.Marshal(object); err == nil {
			return data
		}
	case types.JSONPatchType:
		var operations []any
		if json.Unmarshal(patch.Data, &operations) != nil {
			return patch.Data
		}
		test := map[string]any{"op": "test", "path": "/metadata/uid", "value": string(pod.UID)}
		if data, err := json.Marshal(append([]any{test}, operations...)); err == nil {
			return data
		}
	}
	return patch.Data
}
GO
  (cd "$dir" && go mod edit -replace "sigs.k8s.io/kwok=./kwok-src" && go mod tidy >/dev/null)
}

# etcd: the server module's main package; its siblings (api, client, pkg) at the same version
if [[ ! -x "$dest/bin/etcd" ]]; then
  step "etcd $ETCD_VERSION: resolving modules"
  wrapper "$work/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/ "$ETCD_VERSION"
  (cd "$work/etcd" && echo 'package main; import _ "go.etcd.io/etcd/server/v3/etcdmain"' > tools.go && go mod tidy >/dev/null)
  build "$work/etcd" etcd go.etcd.io/etcd/server/v3
fi

# Kubernetes: k8s.io/kubernetes with each staging module (k8s.io/api, …) at its published v0.MINOR.PATCH
if ! complete; then
  staging="v0.${KUBERNETES_VERSION#v1.}"
  step "Kubernetes $KUBERNETES_VERSION (staging modules $staging): resolving modules"
  wrapper "$work/kubernetes" k8s.io/kubernetes "$KUBERNETES_VERSION" k8s.io/ "$staging"
  minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
  kver="-X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$work/kubernetes" && printf 'package main\nimport (\n_ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"\n_ "k8s.io/kubernetes/cmd/kube-scheduler/app"\n)\n' > tools.go && go mod tidy >/dev/null)
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    [[ -x "$dest/bin/$b" ]] || build "$work/kubernetes" "$b" "k8s.io/kubernetes/cmd/$b" "$kver"
  done
  # KWOK: no replace directives; built in its own module so its Kubernetes libraries are its own
  if [[ ! -x "$dest/bin/kwok" || ! -f "$kwok_patched" ]]; then
    step "KWOK $KWOK_VERSION: resolving modules"
    rm -rf "$work/kwok" && mkdir -p "$work/kwok"
    printf 'module gpupool.local/kwoktools\ngo 1.24\n' > "$work/kwok/go.mod"
    (cd "$work/kwok" && printf 'package main\nimport _ "sigs.k8s.io/kwok/cmd/kwok"\n' > tools.go && go get "sigs.k8s.io/kwok@$KWOK_VERSION" >/dev/null && go mod tidy >/dev/null)
    kwok_patch "$work/kwok"
    build "$work/kwok" kwok sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
    touch "$kwok_patched"
  fi
fi
if [[ ! -f "$dest/kwok-crds/.complete" ]]; then
# KWOK's stages (pod ready/complete, chaos), from the downloaded module
kwokdir="$(cd "$work/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
rm -rf "$dest/kwok-stages" && mkdir -p "$dest/kwok-stages" && cp -r "$kwokdir/kustomize/stage/." "$dest/kwok-stages/" && chmod -R u+w "$dest/kwok-stages"
touch "$dest/kwok-stages/.complete"
# KWOK's CRDs (Logs: the container logs its kubelet server serves, per pod), from the same module
rm -rf "$dest/kwok-crds" && mkdir -p "$dest/kwok-crds" && cp "$kwokdir/kustomize/crd/bases/"*.yaml "$dest/kwok-crds/" && chmod -R u+w "$dest/kwok-crds"
touch "$dest/kwok-crds/.complete"
fi
complete

# Volcano from its release source: its go.mod already replaces volcano.sh/apis by its staging folder and the
# k8s.io staging modules by their published versions, so `go build` runs inside the unpacked tree.
if ! volcano_complete; then
  if [[ ! -f "$varchive" ]]; then
    echo "kube-tools: $varchive is missing: Volcano is not built and the tests that need it skip." >&2
    echo "  It is the public tag volcano-sh/volcano $VOLCANO_VERSION (commit $VOLCANO_COMMIT):" >&2
    echo "  git archive --prefix=volcano-$VOLCANO_VERSION/ -o $VOLCANO_ARCHIVE $VOLCANO_VERSION (sha256 $VOLCANO_SHA256" >&2
    echo "  for the trimmed archive in ../shared/upstream; another archive of the tag needs its sum in versions.env)." >&2
  else
    got="$(sha256sum "$varchive" | cut -d' ' -f1)"
    if [[ "$got" != "$VOLCANO_SHA256" ]]; then
      echo "kube-tools: refusing $varchive: its sha256 is $got, kube/versions.env pins $VOLCANO_SHA256" >&2
      exit 1
    fi
    step "Volcano $VOLCANO_VERSION: unpacking $VOLCANO_ARCHIVE"
    rm -rf "$vdest/src" && mkdir -p "$vdest/src" "$vdest/bin"
    tar -xzf "$varchive" -C "$vdest/src" --strip-components=1
    [[ -f "$vdest/src/go.mod" ]] || { echo "kube-tools: $varchive holds no go.mod at its top folder" >&2; exit 1; }
    # Volcano's Makefile.def: version, commit and build date into volcano.sh/volcano/pkg/version
    vver="-X 'volcano.sh/volcano/pkg/version.Version=$VOLCANO_VERSION' -X 'volcano.sh/volcano/pkg/version.GitSHA=$VOLCANO_COMMIT' -X 'volcano.sh/volcano/pkg/version.Built=$(date -u '+%Y-%m-%d %H:%M:%S')'"
    for pair in vc-scheduler:./cmd/scheduler vc-controller-manager:./cmd/controller-manager; do
      b="${pair%%:*}"; pkg="${pair#*:}"
      step "building $b ($pkg)"
      (cd "$vdest/src" && go build -trimpath -ldflags "-s -w $vver" -o "$vdest/bin/$b.tmp" "$pkg")
      mv "$vdest/bin/$b.tmp" "$vdest/bin/$b"
    done
    touch "$vdest/src/.complete"
  fi
fi

# YuniKorn: the k8shim with `replace` lines pointing at the unpacked core and scheduler interface (the Go proxy
# refuses their module paths); the rest of its go.mod is its own (it already pins the k8s.io modules).
if ! yunikorn_complete; then
  missing=()
  for a in "$YUNIKORN_SHIM_ARCHIVE" "$YUNIKORN_CORE_ARCHIVE" "$YUNIKORN_SI_ARCHIVE"; do
    [[ -f "$upstream/$a" ]] || missing+=("$a")
  done
  if (( ${#missing[@]} )); then
    echo "kube-tools: ${missing[*]} missing in $upstream: YuniKorn is not built and the tests that need it skip." >&2
    echo "  They are \`git archive\` of the public tags apache/yunikorn-k8shim $YUNIKORN_VERSION (commit $YUNIKORN_COMMIT)," >&2
    echo "  yunikorn-core and yunikorn-scheduler-interface (sha256 in kube/versions.env)." >&2
  else
    for pair in "$YUNIKORN_SHIM_ARCHIVE:$YUNIKORN_SHIM_SHA256" "$YUNIKORN_CORE_ARCHIVE:$YUNIKORN_CORE_SHA256" \
                "$YUNIKORN_SI_ARCHIVE:$YUNIKORN_SI_SHA256"; do
      a="${pair%%:*}"; want="${pair#*:}"
      got="$(sha256sum "$upstream/$a" | cut -d' ' -f1)"
      if [[ "$got" != "$want" ]]; then
        echo "kube-tools: refusing $upstream/$a: its sha256 is $got, kube/versions.env pins $want" >&2
        exit 1
      fi
    done
    step "YuniKorn $YUNIKORN_VERSION: unpacking the k8shim, core and scheduler interface"
    rm -rf "$ydest/src" && mkdir -p "$ydest/src/k8shim" "$ydest/src/core" "$ydest/src/si" "$ydest/bin"
    tar -xzf "$upstream/$YUNIKORN_SHIM_ARCHIVE" -C "$ydest/src/k8shim" --strip-components=1
    tar -xzf "$upstream/$YUNIKORN_CORE_ARCHIVE" -C "$ydest/src/core" --strip-components=1
    tar -xzf "$upstream/$YUNIKORN_SI_ARCHIVE" -C "$ydest/src/si" --strip-components=1
    # The REST server on loopback, its port from $YUNIKORN_REST_PORT (see the head of this file); the build
    # stops if core's line is not the one this patch knows.
    web="$ydest/src/core/pkg/webservice"
    grep -q 'Addr:              ":9080",' "$web/webservice.go" || {
      echo "kube-tools: $web/webservice.go no longer binds \":9080\": the loopback patch needs updating" >&2; exit 1; }
    sed -i 's|Addr:              ":9080",|Addr:              restAddress(),|' "$web/webservice.go"
    cat > "$web/gpupool_listen.go" <<'GO'
package webservice

import "os"

// restAddress: patched in by gpupool's kube/build-tools.sh: loopback only, the port from YUNIKORN_REST_PORT.
func restAddress() string {
	if port := os.Getenv("YUNIKORN_REST_PORT"); port != "" {
		return "127.0.0.1:" + port
	}
	return "127.0.0.1:9080"
}
GO
    # core's own go.mod needs the interface too (it requires it at the same version)
    (cd "$ydest/src/core" && go mod edit -replace "github.com/apache/yunikorn-scheduler-interface=../si")
    (cd "$ydest/src/k8shim" && go mod edit -replace "github.com/apache/yunikorn-core=../core" \
       -replace "github.com/apache/yunikorn-scheduler-interface=../si")
    flag=github.com/apache/yunikorn-k8shim/pkg/conf
    yver="-X $flag.buildVersion=${YUNIKORN_VERSION#v} -X $flag.buildDate=$(date -u +%FT%TZ) -X $flag.isPluginVersion=false -X $flag.goVersion=$(go env GOVERSION) -X $flag.arch=$(go env GOARCH)"
    step "building yunikorn-scheduler (./pkg/cmd/shim)"
    (cd "$ydest/src/k8shim" && go build -trimpath -ldflags "-s -w $yver" -o "$ydest/bin/yunikorn-scheduler.tmp" ./pkg/cmd/shim)
    mv "$ydest/bin/yunikorn-scheduler.tmp" "$ydest/bin/yunikorn-scheduler"
    touch "$ydest/src/.complete"
  fi
fi
rm -rf "$GOCACHE"
step "done: $(du -sh "$dest/bin" | cut -f1) of binaries in $dest/bin, $(du -sh "$vdest" 2>/dev/null | cut -f1) in $vdest, $(du -sh "$ydest" 2>/dev/null | cut -f1) in $ydest (Go modules: $(du -sh "$(go env GOMODCACHE)" | cut -f1) in $(go env GOMODCACHE))"
