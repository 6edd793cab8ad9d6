#!/usr/bin/env bash
# Build the real Kubernetes control plane the tests run against, from the Go module proxy, pinned by
# kube/versions.env: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK (nodes and pod
# lifecycles without a kubelet). Output: $GPUPOOL_KUBE_CACHE/<versions>/bin (default ~/.cache/gpupool/kube),
# never inside the repository. Idempotent: a complete set is left alone.
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
# complete: every binary, KWOK's stages and its CRDs (copied last)
complete() {
  for b in "${bins[@]}"; do [[ -x "$dest/bin/$b" ]] || return 1; done
  [[ -f "$dest/kwok-stages/.complete" && -f "$dest/kwok-crds/.complete" ]]
}
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dest"; exit 0; fi
if complete; then echo "kube-tools: up to date in $dest/bin"; exit 0; fi
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
  if [[ ! -x "$dest/bin/kwok" ]]; then
    step "KWOK $KWOK_VERSION: resolving modules"
    mkdir -p "$work/kwok"
    printf 'module gpupool.local/kwoktools\ngo 1.24\n' > "$work/kwok/go.mod"
    (cd "$work/kwok" && printf 'package main\nimport _ "sigs.k8s.io/kwok/cmd/kwok"\n' > tools.go && go get "sigs.k8s.io/kwok@$KWOK_VERSION" >/dev/null && go mod tidy >/dev/null)
    build "$work/kwok" kwok sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
  fi
fi
# KWOK's stages (pod ready/complete, chaos), from the downloaded module
kwokdir="$(cd "$work/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
rm -rf "$dest/kwok-stages" && mkdir -p "$dest/kwok-stages" && cp -r "$kwokdir/kustomize/stage/." "$dest/kwok-stages/" && chmod -R u+w "$dest/kwok-stages"
touch "$dest/kwok-stages/.complete"
# KWOK's CRDs (Logs: the container logs its kubelet server serves, per pod), from the same module
rm -rf "$dest/kwok-crds" && mkdir -p "$dest/kwok-crds" && cp "$kwokdir/kustomize/crd/bases/"*.yaml "$dest/kwok-crds/" && chmod -R u+w "$dest/kwok-crds"
touch "$dest/kwok-crds/.complete"
complete
rm -rf "$GOCACHE"
step "done: $(du -sh "$dest/bin" | cut -f1) of binaries in $dest/bin (Go modules: $(du -sh "$(go env GOMODCACHE)" | cut -f1) in $(go env GOMODCACHE))"
