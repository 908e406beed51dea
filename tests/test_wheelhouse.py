"""``nvlab wheelhouse``: target tags, markers judged for the target, placeholders for what an NGC image has, and a
real offline install: build a wheelhouse from PyPI, install it with no index into a fresh virtual environment,
import lab_utils and run nvlab doctor (marked ``network``: it downloads from PyPI; CI runs it)."""

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from nvlab import cli
from nvlab.ops import stack as stack_files
from nvlab.ops import wheelhouse
from nvlab.ops.wheelhouse import WheelhouseError

ROOT = Path(__file__).resolve().parent.parent


# --- target ---------------------------------------------------------------------------------------


def test_named_platforms_expand_to_every_older_manylinux_tag():
    arch, tags = wheelhouse.platform_tags(["linux_x86_64"])
    assert arch == "x86_64" and tags[0] == "manylinux_2_35_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64"} <= set(tags)
    arch, tags = wheelhouse.platform_tags(["manylinux_2_39_aarch64"])
    assert arch == "aarch64" and tags[0] == "manylinux_2_39_aarch64" and "manylinux_2_35_aarch64" in tags


def test_default_platform_is_this_machine():
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("not an x86_64 or aarch64 machine")
    assert wheelhouse.platform_tags(None)[0] == platform.machine()


@pytest.mark.parametrize("plat, kind", [("win_amd64", "Windows"), ("macosx_14_0_arm64", "macOS"),
                                        ("musllinux_1_2_x86_64", "musl"), ("linux_ppc64le", "ppc64le")])
def test_unsupported_platform_says_which(plat, kind):
    with pytest.raises(WheelhouseError) as err:
        wheelhouse.platform_tags([plat])
    msg = str(err.value)
    assert repr(plat) in msg and kind in msg and "linux_x86_64" in msg


def test_one_architecture_per_wheelhouse():
    with pytest.raises(WheelhouseError, match="mixes aarch64 and x86_64"):
        wheelhouse.platform_tags(["linux_x86_64", "linux_aarch64"])


def test_target_python():
    assert wheelhouse.target_python("3.12") == "3.12" and wheelhouse.target_python("cp311") == "3.11"
    assert wheelhouse.target_python(None) == f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(WheelhouseError, match="needs Python >= 3.10"):
        wheelhouse.target_python("3.9")
    with pytest.raises(WheelhouseError, match="MAJOR.MINOR"):
        wheelhouse.target_python("latest")


def test_cli_rejects_bad_targets_before_downloading(tmp_path, capsys):
    dest = tmp_path / "wh"
    assert cli.main(["wheelhouse", str(dest), "--platform", "macosx_14_0_arm64"]) == 2
    assert "platform 'macosx_14_0_arm64' (macOS) is not supported" in capsys.readouterr().err
    assert cli.main(["wheelhouse", str(dest), "--extras", "lab,gpu"]) == 2
    assert "--extras gpu: the course's extras are" in capsys.readouterr().err
    assert not dest.exists()


# --- markers for the target, and placeholders --------------------------------------------------------


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", meta)
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def folder(tmp_path):
    make_wheel(tmp_path, "app", "1.0", [
        "dep>=1", 'backport; python_version < "3.11"', 'fancy; extra == "x"', 'linux-only; sys_platform == "linux"',
        'win-only; sys_platform == "win32"', "torch>=2.4", 'arm-only; platform_machine == "aarch64"'])
    make_wheel(tmp_path, "dep", "1.2", ["sub-dep>=2"])
    make_wheel(tmp_path, "sub_dep", "1.0")
    make_wheel(tmp_path, "linux-only", "3.0")
    return tmp_path


def test_requirements_are_judged_for_the_target(folder):
    env312 = wheelhouse.target_environment("3.12", "x86_64")
    provided = {"torch": "2.14.0"}
    # sub-dep is there but too old; torch is provided by the target; markers for 3.12 on Linux x86_64.
    assert wheelhouse.missing_requirements(folder, [("app", ())], env312, provided) == ["sub-dep>=2"]
    env310 = wheelhouse.target_environment("3.10", "aarch64")
    assert wheelhouse.missing_requirements(folder, [("app", ["x"])], env310, provided) == [
        "arm-only", "backport", "fancy", "sub-dep>=2"]
    assert "torch>=2.4" in wheelhouse.missing_requirements(folder, [("app", ())], env312)


@pytest.mark.parametrize("provided", [
    {"torch": "2.14.0a0+5fa4b7e", "tensorrt": "11.3.0.36"},  # as pip lists them in the image
    {"torch": "2.14.0a0", "tensorrt": "11.3.0"},  # stack.pip_version: what the placeholders carry
])
def test_requirements_on_what_the_image_has_are_judged_as_pip_sees_it(tmp_path, provided):
    # NGC's torch 2.14.0 is a pre-release to pip: it meets >=2.4 and <2.15 but not >=2.14 or ==2.14.0.
    make_wheel(tmp_path, "app", "1.0", ["torch>=2.4,<2.15", "tensorrt>=11.3", "old-dep"])
    make_wheel(tmp_path, "old-dep", "1.0", ["torch>=2.14", "tensorrt==11.3.*"])
    make_wheel(tmp_path, "pinned-dep", "1.0", ["torch==2.14.0", "tensorrt<11.3"])
    env = wheelhouse.target_environment("3.12", "x86_64")
    assert wheelhouse.missing_requirements(tmp_path, [("app", ())], env, provided) == ["torch>=2.14"]
    assert wheelhouse.missing_requirements(tmp_path, [("pinned-dep", ())], env, provided) == [
        "tensorrt<11.3", "torch==2.14.0"]


def download(links: Path, dest: Path, args: list[str], *reqs: str) -> None:
    """pip download with no index from ``links``, through the wheelhouse's own error handling."""
    wheelhouse._pip(["download", "--no-index", "--find-links", str(links), "--dest", str(dest), *args, *reqs],
                    "downloading", "3.12", "x86_64", hint="HINT: what the image has")


def test_placeholders_stand_for_preinstalled_packages(tmp_path, monkeypatch):
    """Offline: a package that needs torch resolves against the placeholder at the version pip will see in the
    image, never a real torch; one that needs a newer torch than the image's fails here, as it would there."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "needs-torch", "1.0", ["torch>=2.4", "numpy"])
    make_wheel(links, "needs-final-torch", "1.0", ["torch>=2.14"])
    make_wheel(links, "numpy", "2.0.0")
    make_wheel(links, "torch", "2.99.0")  # what an index would offer: must not be chosen
    image = stack_files.pip_version("torch")  # 2.14.0a0
    args = wheelhouse.placeholder_args(tmp_path, {"torch": image})
    dest = tmp_path / "dest"
    download(links, dest, args, "needs-torch")
    names = sorted(p.name for p in dest.glob("*.whl"))
    assert names == ["needs_torch-1.0-py3-none-any.whl", "numpy-2.0.0-py3-none-any.whl",
                     f"torch-{image}+{wheelhouse.STUB_LABEL}-py3-none-any.whl"]
    assert wheelhouse.wheel_metadata(dest / names[-1])[:2] == ("torch", f"{image}+{wheelhouse.STUB_LABEL}")
    with pytest.raises(WheelhouseError, match="the requirements conflict. HINT: what the image has"):
        download(links, tmp_path / "dest2", args, "needs-final-torch")


def test_build_runs_to_its_end_with_pip_stood_in(tmp_path, monkeypatch):
    """build() past pip to the wheelhouse and its README without a network (only the nightly network test ran the
    end of a build, and a constructor call with one argument too many failed every build there)."""
    def pip(args, what, python, arch, hint=""):
        out = Path(args[args.index("--wheel-dir" if args[0] == "wheel" else "--dest") + 1])
        out.mkdir(parents=True, exist_ok=True)
        make_wheel(out, "nvlab", "0.1.0")  # the course's wheel, built or downloaded

    monkeypatch.setattr(wheelhouse, "_pip", pip)
    monkeypatch.setattr(wheelhouse, "missing_requirements", lambda *a, **k: [])
    house = wheelhouse.build(tmp_path / "house", extras=("lab",), log=lambda line: None)
    assert house.wheels == ["nvlab-0.1.0-py3-none-any.whl"] and house.extras == ["lab"]
    assert "nvlab" in (tmp_path / "house" / "README.txt").read_text()


def test_install_commands_are_no_index_and_match_the_course():
    cmds = wheelhouse.install_commands("WHEELHOUSE", "lab")
    assert cmds[0] == "python -m pip install --no-index --find-links WHEELHOUSE -e '.[lab]'"
    assert cmds[1].endswith("--no-deps nvidia-pytriton==0.7.0") and "--no-index" in cmds[1]
    assert cmds[-1] == "nvlab doctor"
    assert wheelhouse.install_commands("W", "")[0] == "python -m pip install --no-index --find-links W -e '.'"


# --- the real thing: PyPI -> wheelhouse -> fresh venv with no index --------------------------------------


def offline_env(venv: Path) -> dict[str, str]:
    """The environment of the target: no pip configuration, no index, the fresh venv's python first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    # PIP_NO_COMPILE only skips writing .pyc files: it keeps the test within its two minutes on a 2-core runner.
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_COMPILE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")
    return env


def sh(cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.network
@pytest.mark.nightly
def test_offline_install_from_a_fresh_wheelhouse(tmp_path):
    t0 = time.perf_counter()
    wh = tmp_path / "wheelhouse"
    # The course without extras for this machine's Python: a small download (about 70 MB), as the README says.
    out = subprocess.run([sys.executable, "-m", "nvlab", "wheelhouse", str(wh), "--extras", ""],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    t_build = time.perf_counter() - t0
    names = [p.name for p in wh.glob("*.whl")]
    assert any(n.startswith("nvlab-") for n in names) and any(n.startswith("setuptools-") for n in names)
    assert not any(n.startswith("torch-") for n in names)
    readme = (wh / "README.txt").read_text()
    commands = wheelhouse.install_commands(str(wh), "")
    for cmd in commands:
        assert cmd in readme

    # A fresh virtual environment and a copy of the checkout (the editable install writes its metadata there).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    course = tmp_path / "course"
    course.mkdir()
    for f in ("pyproject.toml", "README.md"):
        (course / f).write_bytes((ROOT / f).read_bytes())
    subprocess.run(["cp", "-r", str(ROOT / "lab_utils"), str(course)], check=True)
    env = offline_env(venv)

    install = sh(commands[0], cwd=course, env=env)  # exactly the README's command, with no index
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    check = sh("python -m pip check", cwd=course, env=env)  # every installed requirement came from the wheelhouse
    assert check.returncode == 0, check.stdout + check.stderr
    where = sh("python -c 'import lab_utils, lab_utils.course.probe, nvlab.cli; print(lab_utils.__file__)'",
               env=env,
               cwd=tmp_path)  # not the checkout's folder, which python -c would import from
    assert where.returncode == 0 and where.stdout.strip() == str(course / "lab_utils" / "__init__.py"), where.stderr

    # torch is what the target brings (the NGC image's, or the wheelhouse's torch extra): lend this one.
    import torch

    site = sh("python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'", env=env).stdout.strip()
    Path(site, "zz_target_torch.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")
    doctor = sh(commands[-1], cwd=course, env=env)  # exit 0: every required package is importable
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    assert "Lab tiers on this machine" in doctor.stdout and "cannot run" not in doctor.stderr
    total = time.perf_counter() - t0
    print(f"wheelhouse {t_build:.0f} s, whole offline install and doctor {total:.0f} s")
    assert total < 300, f"took {total:.0f} s"
