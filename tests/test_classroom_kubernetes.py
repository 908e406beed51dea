"""The classroom on Kubernetes (docker/classroom/kubernetes/): the course's values for the Zero to JupyterHub chart,
checked offline by the chart's and Kubernetes' own code. No cluster and no helm binary: the values against the
chart's values schema (jsonschema, and Helm's own check); the chart rendered with them by Helm's Go code as a library
(helm-python-sdk, `helm template`); every rendered object against the Kubernetes API schemas (kubernetes-validate,
strict: unknown fields refused) of the oldest and newest Kubernetes the chart's CI tests (1.32 and 1.35); and the
pods KubeSpawner itself builds for each profile, from the hub configuration that the chart's own
jupyterhub_config.py makes of the rendered files. The labs' seeding hook runs for real, with bash.

Run as a script (``python tests/test_classroom_kubernetes.py ROOT OUT``), this file is the hub side: ROOT holds the
hub pod's mounted files, OUT receives the pods as JSON (a process of its own: the chart's z2jh module caches the
configuration it reads once)."""

from __future__ import annotations

import asyncio
import base64
import copy
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "docker" / "classroom" / "kubernetes"
CHART = K8S / "z2jh-chart"
VALUES = K8S / "values.yaml"
DOCKERFILE = K8S / "Dockerfile"
GUIDE = ROOT / "docs" / "classroom_kubernetes.md"
# The chart's kubeVersion is ">=1.32.0-0"; its CI runs k3s 1.32 to 1.35 (and "latest").
KUBE_VERSIONS = ("1.32.0", "1.35.0")
HUB_MOUNT = "/usr/local/etc/jupyterhub"
RELEASE = NAMESPACE = "nvlab"


def h200_mig_profiles() -> dict[str, dict]:
    """The H200's MIG profiles as the GPU reports them (``nvidia-smi mig -lgip``, the course's capture), media
    variants left out: profile -> instances per GPU, SMs, memory in GiB as printed."""
    from lab_utils.course import probe

    rows = re.findall(r"MIG (\d+g\.\d+gb)\s+\d+\s+\d+/(\d+)\s+([\d.]+)\s+\w+\s+(\d+)", probe.capture("mig-profiles"))
    return {name: {"instances": int(n), "gib": gib, "sms": int(sm)} for name, n, gib, sm in rows}


def mig_profiles() -> dict[str, dict[str, int]]:
    """MIG profiles by GPU: profile -> instances per GPU. The H200's as it reports them; the H100 80GB's from NVIDIA's
    MIG User Guide ("Supported MIG Profiles"). With the GPU Operator's "mixed" strategy each is a resource of its
    own, nvidia.com/mig-<profile>."""
    return {
        "H200": {name: p["instances"] for name, p in h200_mig_profiles().items()},
        "H100 80GB": {"1g.10gb": 7, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1},
    }


# The test extra installs these (through the classroom-k8s extra): missing, the suite says how instead of skipping,
# except where helm-python-sdk has no wheel (Intel macOS), which pyproject.toml's marker leaves out.
if (sys.platform, platform.machine()) == ("darwin", "x86_64") and importlib.util.find_spec("helm_python") is None:
    pytest.skip("helm-python-sdk has no wheel for Intel macOS: the Kubernetes checks run on Linux",
                allow_module_level=True)
try:
    import helm_python  # noqa: F401
    import jsonschema
    import kubernetes_validate
    from kubernetes.utils import quantity
except ImportError as e:
    raise ImportError(f"{e.name} is not installed: pip install -e '.[classroom-k8s]' (the test extra has it)") from e


# --- helpers -------------------------------------------------------------------------------------------------------


def render(values: dict) -> list[dict]:
    """The chart's objects for ``values`` as ``helm template`` makes them (Helm's own Go code, offline)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def invalid(obj: dict, version: str) -> str | None:
    """Why Kubernetes ``version`` refuses ``obj`` (strict schema, then every resource quantity), or None."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message} at {'.'.join(map(str, e.path))}"
    for where, value in quantities(obj):
        try:
            quantity.parse_quantity(value)
        except ValueError as e:
            return f"{obj['kind']}/{obj['metadata'].get('name')}: {where} = {value!r} is no Kubernetes quantity ({e})"
    return None


def quantities(obj, where: str = "") -> list[tuple[str, object]]:
    """Every resource request and limit in ``obj`` (containers, PVCs), as (path, value)."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            path = f"{where}.{key}" if where else key
            if key in ("limits", "requests") and isinstance(value, dict):
                found += [(f"{path}.{name}", q) for name, q in value.items()]
            else:
                found += quantities(value, path)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += quantities(item, f"{where}[{i}]")
    return found


def one(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def lay_out_hub_pod(docs: list[dict], root: Path) -> dict[str, str]:
    """Write the hub container's mounted ConfigMap and Secret files under ``root`` as the kubelet would (the chart's
    z2jh.py reads them from fixed paths, moved under ``root``); return the container's environment, with the
    variables Kubernetes sets for each Service (NAME_SERVICE_PORT)."""
    hub = one(docs, "Deployment", "hub")["spec"]["template"]["spec"]
    sources = {}
    for vol in hub["volumes"]:
        if "configMap" in vol:
            sources[vol["name"]] = one(docs, "ConfigMap", vol["configMap"]["name"])["data"]
        elif "secret" in vol:
            data = one(docs, "Secret", vol["secret"]["secretName"])["data"]
            sources[vol["name"]] = {k: base64.b64decode(v).decode() for k, v in data.items()}
    (container,) = [c for c in hub["containers"] if c["name"] == "hub"]
    for mount in container["volumeMounts"]:
        if mount["name"] not in sources:
            continue  # the database volume
        target = root / mount["mountPath"].lstrip("/")
        files = {target: sources[mount["name"]][mount["subPath"]]} if "subPath" in mount else {
            target / key: text for key, text in sources[mount["name"]].items()}
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace(HUB_MOUNT, str(root / HUB_MOUNT.lstrip("/"))))
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(one(docs, "Secret", ref["name"])["data"][ref["key"]]).decode()
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = NAMESPACE
    for svc in (d for d in docs if d["kind"] == "Service"):
        env[svc["metadata"]["name"].upper().replace("-", "_") + "_SERVICE_PORT"] = str(svc["spec"]["ports"][0]["port"])
    return env


def spawn_manifests(docs: list[dict], workdir: Path) -> dict:
    """The hub configuration and, for every profile, the pod and PVC KubeSpawner builds (this file as a script)."""
    root = workdir / "hub-pod"
    # KubeSpawner loads a client configuration when it is made; building a pod contacts no cluster, so a kubeconfig
    # naming an address where nothing listens stands in for the hub pod's service account.
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "none", "user": {"token": "none"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none", "namespace": NAMESPACE}}],
    }))
    env = {**os.environ, **lay_out_hub_pod(docs, root), "KUBECONFIG": str(kubeconfig)}
    out = workdir / "spawned.json"
    proc = subprocess.run([sys.executable, __file__, str(root), str(out)], capture_output=True, text=True,
                          env=env, cwd=workdir, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _hub_side(root: Path, out: Path) -> None:
    """Load the chart's jupyterhub_config.py from ``root`` (as the hub does) and build each profile's pod."""
    from kubernetes_asyncio.client import ApiClient
    from kubespawner import KubeSpawner
    from traitlets.config.loader import PyFileConfigLoader
    from traitlets.utils.importstring import import_item

    config = PyFileConfigLoader("jupyterhub_config.py", path=str(root / HUB_MOUNT.lstrip("/"))).load_config()

    async def build() -> dict:
        pods = {}
        async with ApiClient() as api:  # its serializer only: nothing is sent
            for profile in config.KubeSpawner.profile_list:
                spawner = KubeSpawner(config=config, _mock=True)  # a user and hub stand-in: kubespawner's own
                spawner.user_options = {"profile": profile["slug"]}
                await spawner.load_user_options()
                pods[profile["slug"]] = {
                    "pod": api.sanitize_for_serialization(await spawner.get_pod_manifest()),
                    "pvc": api.sanitize_for_serialization(spawner.get_pvc_manifest()),
                }
        return pods

    authenticator = import_item(config.JupyterHub.authenticator_class)  # the class the hub would load
    hub = {
        "authenticator_class": f"{authenticator.__module__}.{authenticator.__name__}",
        "template_paths": list(config.JupyterHub.template_paths),
        "services": list(config.JupyterHub.services),
        "authenticator": dict(config.Authenticator),
        "native": dict(config.NativeAuthenticator),
    }
    out.write_text(json.dumps({"hub": hub, "profiles": asyncio.run(build())}, default=str))


# --- fixtures ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


@pytest.fixture(scope="module")
def rendered(values) -> list[dict]:
    return render(values)


@pytest.fixture(scope="module")
def spawned(rendered, tmp_path_factory) -> dict:
    return spawn_manifests(rendered, tmp_path_factory.mktemp("k8s-hub"))


def schema_errors(schema: dict, values: dict) -> list[str]:
    """What the chart's schema says of ``values`` merged over the chart's defaults (as Helm checks them)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in validator.iter_errors(merged)]


# --- the values file and the chart's schema ------------------------------------------------------------------------


def test_values_pass_the_charts_schema_by_jsonschema_and_by_helm(values, schema):
    import helm_python as helm

    assert schema_errors(schema, values) == []
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)  # raises HelmValuesError naming the key


@pytest.mark.parametrize("path, typo", [
    (("singleuser",), "profilList"),       # singleuser.profileList misspelt
    (("cull",), "timout"),                 # cull.timeout misspelt
    (("hub", "config"), "nativeAuthenticator"),  # a traitlets section must be a class name (capital first)
])
def test_the_schema_refuses_a_typo_d_key(values, schema, path, typo):
    import helm_python as helm

    bad = copy.deepcopy(values)
    node = bad
    for key in path:
        node = node[key]
    node[typo] = {"x": 1} if path == ("hub", "config") else 1
    errors = schema_errors(schema, bad)
    assert errors and any(typo in e for e in errors), errors
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=typo):
        chart.validate_schema(bad)


# --- the rendered chart ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(rendered, version):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    # the hub, the proxy, both image pullers (hook and continuous) and the hub's volume are there
    assert {("Deployment", "hub"), ("Deployment", "proxy"), ("DaemonSet", "hook-image-puller"),
            ("DaemonSet", "continuous-image-puller"), ("PersistentVolumeClaim", "hub-db-dir")} <= kinds, kinds
    assert [why for d in rendered if (why := invalid(d, version))] == []


def test_the_image_pullers_pull_the_course_image_onto_gpu_nodes_too(rendered, values):
    image = f"{values['singleuser']['image']['name']}:{values['singleuser']['image']['tag']}"
    for name in ("hook-image-puller", "continuous-image-puller"):
        spec = one(rendered, "DaemonSet", name)["spec"]["template"]["spec"]
        assert image in [c["image"] for c in spec["initContainers"]], name
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], name


@pytest.mark.parametrize("bad, why", [
    (["16G"], "is not valid under any of the given schemas"),  # a list where a quantity goes: the API schema refuses it
    ("16 GB", "no Kubernetes quantity"),  # a string Kubernetes cannot parse: the client's quantity parser refuses it
])
def test_a_bad_resource_quantity_is_refused(rendered, bad, why):
    hub = copy.deepcopy(one(rendered, "Deployment", "hub"))
    hub["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"memory": bad}}
    assert why in (invalid(hub, KUBE_VERSIONS[0]) or "accepted")


# --- the pods KubeSpawner builds for each profile -------------------------------------------------------------------


def _container(pod: dict) -> dict:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    return c


def test_the_hub_is_configured_with_native_authenticator_and_the_idle_culler(spawned):
    import nativeauthenticator

    hub = spawned["hub"]
    assert hub["authenticator_class"] == "nativeauthenticator.nativeauthenticator.NativeAuthenticator"
    assert hub["authenticator"]["allow_all"] is True and hub["authenticator"]["admin_users"] == ["trainer"]
    assert hub["native"]["open_signup"] is False  # the trainer approves every sign-up
    # the sign-up and authorize pages' templates are where the installed package keeps them
    assert hub["template_paths"] == [str(Path(nativeauthenticator.__file__).parent / "templates")]
    assert Path(hub["template_paths"][0], "signup.html").is_file()
    (culler,) = [s for s in hub["services"] if s["name"] == "jupyterhub-idle-culler"]
    assert "--timeout=3600" in culler["command"] and "--cull-every=300" in culler["command"]


def test_every_profile_is_spawned_and_its_pod_and_volume_are_valid(spawned, values):
    slugs = [p["slug"] for p in values["singleuser"]["profileList"]]
    assert list(spawned["profiles"]) == slugs
    assert {"cpu", "gpu"} <= set(slugs) and any(s.startswith("mig-h200") for s in slugs)
    problems = [why for s in slugs for obj in spawned["profiles"][s].values() for v in KUBE_VERSIONS
                if (why := invalid(obj, v))]
    assert problems == []


@pytest.mark.parametrize("slug, resource", [
    ("cpu", None),
    ("gpu", "nvidia.com/gpu"),
    ("mig-h200-1g-18gb", "nvidia.com/mig-1g.18gb"),
    ("mig-h200-3g-71gb", "nvidia.com/mig-3g.71gb"),
    ("mig-h100-1g-10gb", "nvidia.com/mig-1g.10gb"),
    ("mig-h100-3g-40gb", "nvidia.com/mig-3g.40gb"),
])
def test_each_profile_asks_for_its_gpu_share_and_lands_on_gpu_nodes(spawned, slug, resource):
    pod = spawned["profiles"][slug]["pod"]
    limits = _container(pod)["resources"]["limits"]
    gpu = {k: v for k, v in limits.items() if k.startswith("nvidia.com/")}
    tolerations = pod["spec"].get("tolerations") or []
    gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    if resource is None:
        assert gpu == {} and gpu_toleration not in tolerations
        return
    assert gpu == {resource: "1"}  # one device of one kind: the device plugin hands out exactly that
    assert gpu_toleration in tolerations
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # a profile's tolerations replace the chart's: z2jh's user-node toleration must still be there
    assert {"key": "hub.jupyter.org/dedicated", "operator": "Equal", "value": "user", "effect": "NoSchedule"} \
        in tolerations


def test_every_gpu_resource_named_is_a_real_mig_profile(values):
    known = {"nvidia.com/gpu"} | {f"nvidia.com/mig-{p}" for g in mig_profiles().values() for p in g}
    named = set(re.findall(r"nvidia\.com/(?:gpu|mig-[\w.]+)", VALUES.read_text()))
    assert named and named <= known, named - known


def test_the_student_pod_runs_the_course_image_as_lab_on_a_volume_of_its_own(spawned, values):
    pod = spawned["profiles"]["gpu"]["pod"]
    c = _container(pod)
    image = values["singleuser"]["image"]
    assert c["image"] == f"{image['name']}:{image['tag']}"
    assert c["args"][0] == "jupyterhub-singleuser" and c["workingDir"] == "/home/lab"
    assert c["securityContext"]["runAsUser"] == 1000 and pod["spec"]["securityContext"]["fsGroup"] == 1000
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    pvc = spawned["profiles"]["gpu"]["pvc"]
    assert volumes[mounts["/home/lab"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert c["lifecycle"]["postStart"]["exec"]["command"][:2] == ["bash", "-c"]


def test_a_pod_with_a_typo_d_field_is_refused(spawned):
    pod = copy.deepcopy(spawned["profiles"]["gpu"]["pod"])
    c = _container(pod)
    c["resource"] = c.pop("resources")  # strict: a field Kubernetes does not know
    assert "resource" in (invalid(pod, KUBE_VERSIONS[-1]) or "accepted")


# --- the labs' seeding hook, run for real -----------------------------------------------------------------------------


def test_the_seeding_hook_copies_missing_labs_and_never_overwrites_a_students_work(spawned, tmp_path):
    command = _container(spawned["profiles"]["gpu"]["pod"])["lifecycle"]["postStart"]["exec"]["command"]
    course, home = tmp_path / "course-labs", tmp_path / "home"
    shutil.copytree(ROOT / "labs", course)
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "NVLAB_LABS_SOURCE": str(course)}

    def start() -> None:  # a pod start: the hook as KubeSpawner's pod runs it, in the student's home
        out = subprocess.run(command, env=env, cwd=home, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    labs = home / "labs"
    start()  # first start: the student gets the blank labs
    names = sorted(p.name for p in course.glob("*.ipynb"))
    assert names and sorted(p.name for p in labs.glob("*.ipynb")) == names
    assert (labs / names[0]).read_bytes() == (course / names[0]).read_bytes()

    edited = labs / names[0]
    edited.write_text(edited.read_text() + "\n")  # the student's work
    mine = edited.read_bytes()
    start()  # a later start changes nothing
    assert edited.read_bytes() == mine and sorted(p.name for p in labs.glob("*.ipynb")) == names

    (course / names[0]).write_text((course / names[0]).read_text().replace("nvlab", "nvlab (v2)", 1))
    (course / "10_new.ipynb").write_text("{}")
    start()  # a new course version: the changed lab comes beside the student's copy, a new lab is copied
    assert edited.read_bytes() == mine
    beside = sorted(labs.glob(Path(names[0]).stem + ".course-*.ipynb"))
    assert len(beside) == 1 and beside[0].read_bytes() == (course / names[0]).read_bytes()
    assert (labs / "10_new.ipynb").read_text() == "{}"

    (labs / names[1]).unlink()  # a deleted lab comes back blank, and nothing else is copied again
    before = {p.name for p in labs.iterdir()}
    start()
    assert (labs / names[1]).read_bytes() == (course / names[1]).read_bytes()
    assert {p.name for p in labs.iterdir()} == before | {names[1]} and edited.read_bytes() == mine
    assert f"copied {names[1]} to labs/{names[1]}" in (home / ".nvlab-seed.log").read_text()


def test_the_seeding_hook_never_fails_the_pod(spawned, tmp_path):
    command = _container(spawned["profiles"]["cpu"]["pod"])["lifecycle"]["postStart"]["exec"]["command"]
    env = {**os.environ, "HOME": str(tmp_path), "NVLAB_LABS_SOURCE": str(tmp_path / "missing")}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0  # a failed postStart hook would kill the student's container
    assert "failed" in (tmp_path / ".nvlab-seed.log").read_text()


# --- the course image, the vendored chart and the guide --------------------------------------------------------------


def test_the_course_image_matches_the_manifest_and_the_charts_jupyterhub(values):
    from lab_utils.course import stack
    from nvlab.ops import stack as stack_files

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    args = stack_files.dockerfile_args(DOCKERFILE.read_text())
    assert values["singleuser"]["image"]["tag"] == args["NGC_TAG"] == stack.manifest()["pinned"]
    # the student's single-user server speaks to the chart's hub: the same JupyterHub release
    assert args["JUPYTERHUB_VERSION"] == chart["appVersion"]
    # the course's JupyterLab settings, which `nvlab lab` passes on its command line, are baked in for the hub
    from nvlab import cli

    settings = cli.LAB_SETTINGS_DIR.relative_to(Path(cli.__file__).parents[1]) / "overrides.json"
    assert f"/workspace/course/{settings}" in DOCKERFILE.read_text() and (ROOT / settings).is_file()


def test_the_vendored_chart_names_its_upstream_commit_and_licence():
    readme = (K8S / "README.md").read_text()
    assert re.search(r"zero-to-jupyterhub-k8s.*\b[0-9a-f]{40}\b", readme, re.S)
    assert "BSD 3-Clause License" in (CHART / "LICENSE").read_text()


def guide_installs() -> list[list[str]]:
    """The guide's `helm upgrade --install` lines (fenced bash blocks, continuations joined), as argv lists."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("helm upgrade --install nvlab ")]


def values_of(argv: list[str]) -> dict:
    """The values a `helm upgrade --install` argv gives the chart: --values files, then --set/--set-json, as Helm
    merges them (later wins), each parsed by Helm's own parser."""
    import helm_python as helm

    def merge(into: dict, new: dict) -> dict:
        for k, v in new.items():
            into[k] = merge(into.get(k, {}), v) if isinstance(v, dict) and isinstance(into.get(k), dict) else v
        return into

    files, sets = [], []
    for flag, arg in zip(argv, argv[1:], strict=False):  # each flag with the word after it
        if flag in ("--values", "-f"):
            files.append(yaml.safe_load((ROOT / arg).read_text()))
        elif flag == "--set":
            sets.append(helm.parse_set_string(arg))
        elif flag == "--set-json":
            sets.append(helm.parse_set_json(arg))
    assert files, f"no --values in {' '.join(argv)}"
    out: dict = {}
    for layer in files + sets:
        merge(out, copy.deepcopy(layer))
    return out


def test_every_install_line_of_the_guide_renders_a_valid_hub(schema):
    installs = guide_installs()
    assert len(installs) == 3  # plain, HTTPS from Let's Encrypt, HTTPS with the trainer's certificate
    for argv in installs:
        line = " ".join(argv)
        assert argv[4] == "jupyterhub" and "--repo" in argv and "docker/classroom/kubernetes/values.yaml" in argv, line
        values = values_of(argv)
        assert schema_errors(schema, values) == [], line
        docs = render(values)
        assert [why for d in docs if (why := invalid(d, KUBE_VERSIONS[0]))] == [], line
        https = values.get("proxy", {}).get("https", {})
        if https.get("type") == "secret":
            volumes = one(docs, "Deployment", "proxy")["spec"]["template"]["spec"]["volumes"]
            assert any(v.get("secret", {}).get("secretName") == "nvlab-tls" for v in volumes), line
        elif https.get("enabled"):
            one(docs, "Deployment", "autohttps")  # Let's Encrypt: the chart's Traefik in front of the proxy


def test_the_guide_installs_these_values_and_sizes_a_class_per_mig_profile():
    text = GUIDE.read_text()
    assert "helm upgrade --install" in text and "docker/classroom/kubernetes/values.yaml" in text
    assert 'strategy' in text and "mixed" in text
    for gpu, profiles in mig_profiles().items():  # students per GPU and per 8-GPU node, profile by profile
        for profile, count in profiles.items():
            assert re.search(rf"`{re.escape(profile)}` \| {count} \| {8 * count} \|", text), (gpu, profile, count)
    for profile, p in h200_mig_profiles().items():  # and the H200's SMs and memory as the GPU reports them
        assert f"`{profile}` | {p['instances']} | {8 * p['instances']} | {p['sms']} | {p['gib']} GiB |" in text, profile


def test_the_guide_sizes_each_lab_by_its_measured_gpu_memory():
    """Each lab's peak on the H200 (the reference run) and the smallest slice with 1 GiB beside it, from the capture."""
    measured = json.loads((ROOT / "reference_runs" / "h200" / "gpu_memory_by_lab.json").read_text())["labs"]
    slices = sorted(h200_mig_profiles().items(), key=lambda kv: (float(kv[1]["gib"]), kv[1]["sms"]))
    text = GUIDE.read_text()
    for lab, m in measured.items():
        fits = next(f"`{name}`" for name, p in slices if float(p["gib"]) >= m["peak_gib"] + 1)
        smallest = "none needed (NVML only)" if m["peak_mib"] == 0 else fits
        assert f"| {lab} | {m['peak_gib']:.1f} GiB | {smallest} |" in text, (lab, m, smallest)


def test_the_h200_capture_has_the_profiles_the_course_names():
    profiles = h200_mig_profiles()
    assert profiles["1g.18gb"] == {"instances": 7, "gib": "16.00", "sms": 16}
    assert profiles["3g.71gb"]["instances"] == 2 and profiles["7g.141gb"]["sms"] == 132


if __name__ == "__main__":
    _hub_side(Path(sys.argv[1]), Path(sys.argv[2]))
