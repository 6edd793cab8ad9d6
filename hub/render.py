"""`gpupool render`: the Kubernetes objects gpupool owns, made from a policy directory, written as YAML.

The objects come from the pure builders in `gpupool.spawner.volcano` (and `gpupool.spawner.yunikorn` when the
policy's `settings.engine` is `yunikorn`: its queue configuration in place of Volcano's Queues); this module only
loads the policies, serializes deterministically and writes to stdout or a folder. `--helm-values` writes the values file that
carries the same objects into the Helm chart (helm/gpupool).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: Written into an --output folder; lists the files the last render wrote, which the next render replaces.
MARKER = ".gpupool-render"
#: In a sub-folder, so that `kubectl apply -f DIR` (which reads *.yaml files, not sub-folders) takes objects only.
JUPYTERHUB_VALUES_FILE = "zero-to-jupyterhub/values.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", metavar="DIR",
                        help="policy directory (default: the policies shipped with gpupool)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", "-o", metavar="DIR",
                       help="write one file per object, and the Zero-to-JupyterHub chart's values as "
                       "zero-to-jupyterhub/values.yaml, into DIR (default: all objects as multi-document YAML "
                       "on stdout)")
    where.add_argument("--helm-values", action="store_true",
                       help="print the values file for the gpupool Helm chart (helm/gpupool) instead: the "
                       "rendered objects, the policy files and the Zero-to-JupyterHub wiring")
    parser.add_argument("--namespace", default="default",
                        help="namespace of the hub and its policy ConfigMap (default: default)")
    parser.add_argument("--release", default="gpupool",
                        help="Helm release name, the prefix of object names (default: gpupool)")
    parser.add_argument("--device-plugin-namespace", default="gpu-operator", metavar="NS",
                        help="namespace of the NVIDIA device plugin, where its time-slicing ConfigMap goes "
                        "(default: gpu-operator)")
    parser.add_argument("--yunikorn-namespace", default="yunikorn", metavar="NS",
                        help="namespace of Apache YuniKorn, where its yunikorn-configs ConfigMap goes when the "
                        "policy's settings.engine is yunikorn (default: yunikorn)")
    parser.add_argument("--no-culler", action="store_true",
                        help="leave gpupool's idle culler out of the hub's wiring (its service and role); the "
                        "chart's values then need `culler.enabled: false` (docs/kubernetes.md)")


def dump(documents: list[Any]) -> str:
    """Multi-document YAML, byte-for-byte the same for the same input: sorted keys, no anchors, strings that
    Kubernetes' Go parser would read as numbers quoted (`spawner.kubeyaml`)."""
    from gpupool.spawner import kubeyaml

    return kubeyaml.dump_all(documents)


def policy_files(directory: Path) -> dict[str, str]:
    """The text of each policy file: the files `load_policy` reads (*.yaml, *.yml directly inside)."""
    from gpupool.policies.loader import policy_file_paths

    return {p.name: p.read_text(encoding="utf-8") for p in policy_file_paths(directory)}


def engine_problems(directory: Path, problems: list[tuple[tuple[str, ...], str]]) -> list[str]:
    """Each problem `gpupool.policies.engines` finds as `<file>: <field>: <message>`, the file being the policy
    file that defines the team or profile (`teams.<name>`, `profiles.<name>`) the field belongs to."""
    import yaml

    from gpupool.policies.loader import policy_file_paths

    defined: dict[tuple[str, str], str] = {}
    for path in policy_file_paths(directory):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):  # loaded a moment ago; a file changed since is reported elsewhere
            continue
        for section in ("teams", "profiles"):
            for name in (data.get(section) or {}) if isinstance(data, dict) else {}:
                defined.setdefault((section, name), str(path))
    return [f"{defined.get(tuple(path[:2]), str(directory))}: {'.'.join(path)}: {message}"
            for path, message in problems]


def object_filename(index: int, obj: dict[str, Any]) -> str:
    # The index keeps the apply order (`kubectl apply -f DIR` reads files in name order): parent queues first.
    return f"{index:03d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_folder(folder: Path, files: dict[str, str]) -> None:
    """Write `files` into `folder`, replacing what the previous render there wrote and nothing else."""
    marker = folder / MARKER
    if folder.exists():
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a directory")
        if marker.exists():
            for name in marker.read_text().splitlines()[1:]:
                (folder / name).unlink(missing_ok=True)
                if (folder / name).parent != folder and not any((folder / name).parent.iterdir()):
                    (folder / name).parent.rmdir()
        elif any(folder.iterdir()):
            # A stale object file would re-create a deleted queue on the next `kubectl apply -f`.
            raise ValueError(f"{folder} is not empty and was not written by gpupool render: choose a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    marker.write_text("# written by gpupool render; the next render there replaces these files\n"
                      + "".join(f"{name}\n" for name in files))


def main(args: argparse.Namespace) -> int:
    from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, engines, load_policy
    from gpupool.policies.model import DNS_LABEL
    from gpupool.spawner import volcano, yunikorn

    directory = Path(args.policies) if args.policies else DEFAULT_POLICY_DIR
    try:
        files = policy_files(directory)
        policy = load_policy(directory)
    except PolicyError as error:
        print(error.report(directory, "nothing was rendered"), file=sys.stderr)
        return 1
    if policy_files(directory) != files:
        # What the cluster gets must be exactly the text that was checked.
        print(f"policy files in {directory} changed while rendering: run gpupool render again", file=sys.stderr)
        return 1
    # A profile whose share backend the engine cannot place: refused when the policy names its engine (it is
    # then declared for the Kubernetes mode), else said (gpupool.policies.engines, docs/kubernetes.md).
    found = engines.refusals(policy)
    if found and engines.engine_named(policy):
        for refusal in found:
            print(f"gpupool render: {refusal}", file=sys.stderr)
        print("gpupool render: nothing was rendered", file=sys.stderr)
        return 1
    engine = policy.settings.engine
    if engine == "yunikorn" and (problems := engines.yunikorn_problems(policy)):
        # What YuniKorn's own validator refuses: it would keep its previous queues and log the reason.
        for line in engine_problems(directory, problems):
            print(f"gpupool render: {line}", file=sys.stderr)
        print("gpupool render: nothing was rendered", file=sys.stderr)
        return 1
    try:
        release = volcano.Release(args.release, args.namespace, args.device_plugin_namespace)
        if engine == "yunikorn" and not (DNS_LABEL.fullmatch(args.yunikorn_namespace)
                                         and len(args.yunikorn_namespace) <= 63):
            raise ValueError(f"yunikorn namespace {args.yunikorn_namespace!r} is not DNS-safe (accepted: lower-case "
                             "letters, digits and '-', starting and ending with a letter or digit, at most 63 "
                             "characters)")
        if args.helm_values:
            if engine == "yunikorn":
                values = yunikorn.helm_values(policy, files, release, culler=not args.no_culler,
                                              namespace=args.yunikorn_namespace)
            else:
                values = volcano.helm_values(policy, files, release, culler=not args.no_culler)
            text = dump([values])
            objects = None
        else:
            objects = (yunikorn.cluster_objects(policy, files, release, args.yunikorn_namespace)
                       if engine == "yunikorn" else volcano.cluster_objects(policy, files, release))
            text = dump(objects)
    except ValueError as error:
        print(f"gpupool render: {error}", file=sys.stderr)
        return 1
    notes = volcano.wiring_notes(policy) + (yunikorn.engine_notes(policy) if engine == "yunikorn"
                                            else volcano.engine_notes(policy))
    notes += [f"in the Kubernetes mode, {refusal}" for refusal in found]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    if objects is None:
        sys.stdout.write(text)
        return 0
    if args.output:
        folder = Path(args.output)
        written = {object_filename(i, obj): dump([obj]) for i, obj in enumerate(objects)}
        written[JUPYTERHUB_VALUES_FILE] = dump([volcano.jupyterhub_values(policy, release,
                                                                      culler=not args.no_culler)])
        try:
            write_folder(folder, written)
        except (ValueError, OSError) as error:
            print(f"gpupool render: {error}", file=sys.stderr)
            return 1
        print(f"wrote {len(written)} files to {folder}: {summary(objects)} and {JUPYTERHUB_VALUES_FILE}")
        return 0
    sys.stdout.write(text)
    # stdout stays pure YAML for `| kubectl apply -f -`; the summary goes to stderr.
    print(f"gpupool render: {summary(objects)} from {directory}", file=sys.stderr)
    return 0


def summary(objects: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for obj in objects:
        counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
    return ", ".join(f"{n} {kind}{'es' if kind.endswith('s') else 's'}" if n != 1 else f"1 {kind}"
                     for kind, n in counts.items())
