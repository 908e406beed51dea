import builtins
import json
import os
import stat
import subprocess
import sys

import pytest

from lab_utils.course import probe as env


def test_captures_parse():
    head = env.parse_smi_header(env.capture("nvidia-smi"))
    assert head == {"driver_version": "580.159.04", "cuda_ceiling": "13.0"}
    topo = env.parse_topology(env.capture("topo"))
    assert topo["labels"] == ["GPU0", "GPU1"] and topo["matrix"] == [["X", "NV18"], ["NV18", "X"]]
    (gpu,) = env.parse_smi_csv(env.capture("query-gpu"))
    assert gpu.name == "NVIDIA H200" and gpu.memory_total_mib == 143771 and gpu.power_limit_w == 700.0


def test_unknown_capture_names_the_known_ones():
    with pytest.raises(ValueError, match="known captures"):
        env.capture("dmesg")


def test_topology_parse_rejects_other_text():
    with pytest.raises(ValueError, match="nvidia-smi topo -m"):
        env.parse_topology("hello")


@pytest.mark.parametrize("raw,text", [(13000, "13.0"), (12040, "12.4"), (12080, "12.8"), (11020, "11.2")])
def test_decode_cuda_version(raw, text):
    assert env.decode_cuda_version(raw) == text


def test_versions_compare_as_numbers():
    assert env.version_tuple("12.10") > env.version_tuple("12.4")


def test_probe_without_gpu_degrades_to_statements(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    r = env.probe()
    if r.gpus:
        pytest.skip("this machine has a GPU")
    assert r.source == "none" and r.compatible is None
    assert any("NVML" in n or "nvidia-ml-py" in n for n in r.notes)
    assert any("nvidia-smi" in n for n in r.notes)
    assert {t.tier for t in r.tiers} == {"cpu"}
    assert r.can_run
    json.loads(r.to_json())


def _fake_smi(tmp_path, csv_text, rc=0):
    script = tmp_path / "nvidia-smi"
    banner = env.capture("nvidia-smi")
    topo = env.capture("topo")
    script.write_text(
        "#!/bin/sh\n"
        f'[ {rc} -ne 0 ] && exit {rc}\n'
        'case "$1" in\n'
        f"  --query-gpu=*) cat <<'X'\n{csv_text}X\n;;\n"
        f"  topo) cat <<'X'\n{topo}X\n;;\n"
        f"  *) cat <<'X'\n{banner}X\n;;\n"
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


CSV2 = (
    "0, NVIDIA H200, GPU-a, 00000000:00:06.0, 9.0, 143771, 1980, 3201, 700.00, 5, 16, 5, 16, "
    "Disabled, Enabled, 580.159.04\n"
    "1, NVIDIA H200, GPU-b, 00000000:00:07.0, 9.0, 143771, 1980, 3201, 700.00, 1, 16, 5, 16, "
    "[N/A], Enabled, 580.159.04\n"
)


def test_nvidia_smi_fallback_when_nvml_is_missing(tmp_path, monkeypatch):
    _fake_smi(tmp_path, CSV2)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    r = env.probe()
    if r.source == "nvml":
        pytest.skip("real NVML present")
    assert r.source == "nvidia-smi"
    assert r.driver_version == "580.159.04" and r.cuda_ceiling == "13.0"
    assert [g.index for g in r.gpus] == [0, 1]
    g = r.gpus[1]
    assert g.compute_capability == "9.0" and g.pcie_gen == 1 and g.pcie_gen_max == 5 and g.mig_mode is None
    assert r.topology["matrix"][0][1] == "NV18"
    # torch here is a CPU build: the GPU is seen but cannot be used, and the verdict says why
    assert r.compatible is False and "CPU-only build" in r.reasons[0]
    assert next(t for t in r.tiers if t.lab == "01").tier == "partial"


def test_broken_nvidia_smi_is_explained(tmp_path, monkeypatch):
    _fake_smi(tmp_path, CSV2, rc=9)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    r = env.probe()
    if r.source == "nvml":
        pytest.skip("real NVML present")
    assert r.source == "none" and any("failed" in n for n in r.notes)


def _gpu(cc="9.0"):
    return [env.GpuInfo(0, "NVIDIA H200", compute_capability=cc)]


def _torch(cuda="13.0", arch=("sm_80", "sm_90"), available=True):
    return {"version": "2.11.0", "cuda": cuda, "cuda_available": available, "arch_list": list(arch),
            "device_count": 1, "nccl": "2.28.9", "cudnn": 91900}


def test_compatibility_verdicts():
    ok, why = env._compatibility(_gpu(), "13.0", _torch())
    assert ok and "compatible" in why[0]
    ok, why = env._compatibility(_gpu(), "12.4", _torch(cuda="13.0"))
    assert ok is False and "update the driver" in why[0]
    ok, why = env._compatibility(_gpu(), "12.4", _torch(cuda="12.8"))
    assert ok and "minor-version" in why[0]
    ok, why = env._compatibility(_gpu("12.0"), "13.0", _torch(arch=("sm_80", "sm_90")))
    assert ok is False and "sm_120" in why[-1]
    ok, why = env._compatibility(_gpu("8.9"), "13.0", _torch(arch=("sm_80", "compute_80")))
    assert ok and "runs sm_80 code" in why[-1] and "binary compatible" in why[-1]  # not PTX: sm_80 runs on 8.9
    ok, why = env._compatibility(_gpu("10.0"), "13.0", _torch(arch=("sm_80", "sm_90", "compute_90")))
    assert ok and "PTX JIT from compute_90" in why[-1]
    ok, why = env._compatibility(_gpu(), "13.0", _torch(cuda=None))
    assert ok is False and "CPU-only" in why[0]
    ok, why = env._compatibility([], None, None)
    assert ok is None


# GPU -> compute capability; the torch arch lists below -> how each GPU runs it (CUDA binary compatibility:
# a cubin for X.y runs on X.z, z >= y; sm_XYa only on X.Y; PTX is JIT-compiled for any GPU at or above it).
_GPUS = {"A100": "8.0", "A10": "8.6", "L4/L40S": "8.9", "H100/H200": "9.0", "B200": "10.0", "RTX 5090": "12.0"}
_ARCH_TABLE = [
    # arch list                                   A100      A10       L4/L40S   H100/H200 B200      RTX 5090
    (("sm_80",),                                  ("native", "native", "native", "none",   "none",   "none")),
    (("sm_80", "sm_86", "sm_90"),                 ("native", "native", "native", "native", "none",   "none")),
    (("sm_86",),                                  ("none",   "native", "native", "none",   "none",   "none")),
    (("sm_90a",),                                 ("none",   "none",   "none",   "native", "none",   "none")),
    (("sm_90a", "compute_90a"),                   ("none",   "none",   "none",   "native", "none",   "none")),
    (("sm_80", "sm_90", "compute_90"),            ("native", "native", "native", "native", "ptx",    "ptx")),
    (("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"),
                                                  ("native", "native", "native", "native", "native", "native")),
    (("sm_100",),                                 ("none",   "none",   "none",   "none",   "native", "none")),
    (("compute_80",),                             ("ptx",    "ptx",    "ptx",    "ptx",    "ptx",    "ptx")),
    (("sm_120", "compute_120"),                   ("none",   "none",   "none",   "none",   "none",   "native")),
]


@pytest.mark.parametrize(("arch", "expected"), _ARCH_TABLE, ids=[",".join(a) for a, _ in _ARCH_TABLE])
def test_arch_support_table(arch, expected):
    got = tuple(env.arch_support(cc, arch)[0] for cc in _GPUS.values())
    assert got == expected, dict(zip(_GPUS, got, strict=True))


@pytest.mark.parametrize(("gpu", "arch"), [("8.6", ("sm_80", "sm_90")), ("8.9", ("sm_80", "sm_86", "sm_90"))])
def test_doctor_runs_ampere_builds_on_later_ampere_and_ada(gpu, arch):
    """A torch built for sm_80 (and sm_86, sm_90) runs natively on an A10 (8.6) and an L4/L40S (8.9): no PTX needed."""
    ok, why = env._compatibility(_gpu(gpu), "13.0", _torch(arch=arch))
    assert ok and "not supported" not in why[-1] and "PTX" not in why[-1]


def test_nvml_error_text_names_the_cause():
    import pynvml

    err = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert "kernel driver is not loaded" in env.nvml_error_text(err)


def test_stack_and_container_tables():
    r = env.probe()
    layers = [row["layer"] for row in env.stack_table(r)]
    assert layers[0] == "GPU hardware" and any("NCCL" in x for x in layers)
    # the container table as lab 00 builds it: the lab's verdict on each image of the manifest
    from lab_utils.course.stack import ngc_images
    from lab_utils.exercises import lab00

    by_image = {i["image"].split("/")[-1]: lab00.cuda_verdict("12.6", i["cuda"], False) for i in ngc_images()}
    assert by_image["tritonserver:24.10-py3"] == "compatible"
    assert by_image["pytorch:26.09-py3"] == "incompatible"


def test_doctor_and_lab00_verdict_agree():
    # `nvlab doctor` (probe._compatibility) and the rule lab 00 teaches (exercises.lab00.cuda_verdict) say the
    # same on every case of the exercise's table: runs (compatible, minor-version) or not, and why.
    from lab_utils.exercises import lab00

    for ceiling, runtime, dc, expected, _ in lab00.VERDICT_CASES:
        assert lab00.cuda_verdict(ceiling, runtime, dc) == expected
        ok, why = env._compatibility(_gpu(), ceiling, _torch(cuda=runtime))
        assert ok is (expected in ("compatible", "minor-version compatibility")), (ceiling, runtime, why)
        assert ("minor-version" in why[0]) is (expected == "minor-version compatibility"), (ceiling, runtime, why)
        if expected in ("forward compatibility needed", "incompatible"):
            assert "forward compatibility" in why[0] and "update the driver" in why[0]
    ok, why = env._compatibility(_gpu(), "12.4", _torch(cuda="12.10"))  # not incompatible: minor-version
    assert ok and "minor-version" in why[0]


# --- ModelOpt: named in lab 03's tier only when it imports --------------------------------------------------------


@pytest.fixture
def no_modelopt(monkeypatch):
    """This process as on a machine without ModelOpt: every ``import modelopt...`` fails as a missing package does."""
    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "modelopt":
            raise ModuleNotFoundError("No module named 'modelopt'", name="modelopt")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def _gpu_report(components, trt=False):
    """A usable H200 as the probe would report it, with these components (TensorRT present or not)."""
    comps = {"tritonserver": env.Component("Triton server", False), "prometheus": env.Component("Prometheus", False),
             **components, "tensorrt": env.Component("TensorRT", trt)}
    report = env.EnvReport("nvml", "580.159.04", "13.0", _gpu(), None, _torch(), comps, True, [], [], [])
    report.tiers = env.lab_tiers(report)
    return report


def _lab03(report):
    return next(t for t in report.tiers if t.lab == "03")


def test_doctor_names_modelopt_in_lab03_only_when_it_imports(no_modelopt, capsys):
    comps = env.probe_components()
    mo = comps["modelopt"]
    assert not mo.present and "No module named 'modelopt'" in mo.note and "pip install nvidia-modelopt" in mo.note
    for trt, runs in ((False, "ONNX Runtime; torch autocast"), (True, "TensorRT engines from the FP32 ONNX file")):
        row = _lab03(_gpu_report(comps, trt=trt))
        assert row.tier == "partial" and row.runs.startswith(runs), row
        assert "ModelOpt" not in row.runs and "FP16, INT8 and FP8 models are skipped" in row.substitutes, row
        assert "pip install nvidia-modelopt" in row.substitutes, row
    # what `nvlab doctor` prints: lab 03's row of the tier table is partial and says how to get ModelOpt
    from lab_utils.course.session import print_report

    print_report(_gpu_report(comps), highlight="03")
    table = capsys.readouterr().out.split("Lab tiers on this machine", 1)[1]
    row03 = table[table.index("│ 03 "):table.index("│ 04 ")]
    assert "PARTIAL" in row03 and "nvidia-modelopt" in row03, row03
    # without a GPU too: the CPU tier runs ONNX Runtime and names no ModelOpt model
    cpu = next(t for t in env.probe().tiers if t.lab == "03")
    assert cpu.tier == "cpu" and "ModelOpt" not in cpu.runs and "pip install nvidia-modelopt" in cpu.substitutes


def test_doctor_names_modelopt_where_it_imports():
    pytest.importorskip("modelopt")
    comps = env.probe_components()
    if not comps["modelopt"].present:
        pytest.skip(f"ModelOpt's ONNX path is incomplete here: {comps['modelopt'].note}")
    assert _lab03(_gpu_report(comps, trt=True)).tier == "full"
    row = _lab03(_gpu_report(comps))
    assert row.runs.startswith("ModelOpt ONNX models in ONNX Runtime") and "skipped" not in row.substitutes


def test_a_report_without_the_components_names_neither():
    row = _lab03(_gpu_report({}))  # a report built by hand (or an older JSON) has no ONNX Runtime or ModelOpt
    assert row.tier == "partial" and "nothing yet" in row.runs and "ModelOpt" not in row.runs


def test_the_probe_imports_modelopt_cheaply():
    """``import modelopt`` only: its ONNX path (lief, a second or two) is left to the lab that quantizes."""
    code = ("import sys; from lab_utils.course import probe; c = probe.probe_components()['modelopt']; "
            "print(c.present, 'modelopt.onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split()[-1] == "False", out.stdout


def test_lab03_quantize_path_without_modelopt_says_what_it_skips(no_modelopt, tmp_path):
    np = pytest.importorskip("numpy")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from lab_utils.exercises import lab03
    from lab_utils.exercises.framework import Status
    from lab_utils.inference import quantize

    ok, why = quantize.modelopt_status()
    assert not ok and "No module named 'modelopt'" in why and "`pip install nvidia-modelopt`" in why
    line = quantize.skip_line("the INT8 model")
    assert line.startswith("Skipped: the INT8 model.") and "pip install nvidia-modelopt" in line
    assert "\n" not in line
    # a model of the digits' input shape: ModelOpt is refused before it is needed, as an ImportError saying why
    graph = helper.make_graph([helper.make_node("Relu", ["input"], ["logits"])], "tiny",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 1, 8, 8])])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    calls = (lambda: quantize.autocast(path, tmp_path / "fp16.onnx"),
             lambda: quantize.quantize_onnx(path, tmp_path / "int8.onnx", x))
    for call in calls:
        with pytest.raises(ImportError, match="pip install nvidia-modelopt") as err:
            call()
        assert isinstance(err.value, quantize.ModelOptMissing)
    # the exercise check: not applicable on this tier, blank or not, and the student's function is not run
    ran = []
    for answer in (None, lambda onnx_path, out_path, x_train: ran.append(1)):
        out = lab03.q3.check(answer, quiet=True)
        assert out.status is Status.NOT_APPLICABLE and "pip install nvidia-modelopt" in out.message, out
    assert not ran
