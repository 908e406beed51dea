"""Lab 07's model path against a real Triton: PNG bytes through the ensemble (preprocess -> ONNX classifier ->
top-k) over HTTP and gRPC, bad input refused per request with a 400, the response cache's hits in the metrics,
versions loaded and refused under explicit model control, and nothing left running. One server for the module."""

from __future__ import annotations

import dataclasses
import functools
import io
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _triton import REQUIRE_ENV, require_server

from lab_utils import procs
from lab_utils.compat import numpy1_env
from lab_utils.exercises import lab07
from lab_utils.models import digits_arrays
from lab_utils.procs import env_flag
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens
from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving.server import TritonServer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    source = require_server()
    try:
        numpy1_env.stub_env(source, build=True)
    except (RuntimeError, OSError) as err:  # pip cannot reach the package index: NumPy 1 for the stub is missing
        if env_flag(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but the python backend's environment cannot be built: {err}")
        pytest.skip(f"the python backend's NumPy-1 environment is not built and cannot be: {err}")
    return ens.build_service_repository(tmp_path_factory.mktemp("lab07") / "repo", source=source)


@pytest.fixture(scope="module")
def server(built):
    # a short grace before SIGKILL, as quick_stop gives per test (what a stop leaves is tested, not its pace)
    with TritonServer(built.path, stop_grace_s=0.3, **built.server_kwargs()) as s:
        yield s


def test_repository_is_valid_and_bad_ensembles_are_named(built):
    entries = triton_repo.validate_repository(built.path, models=list(built.models), gpus=0)
    assert entries[ens.SERVICE].config.platform == "ensemble"
    assert entries[ens.SERVICE].config.response_cache.enable
    cls = entries[ens.CLASSIFIER].config
    assert cls.HasField("dynamic_batching") and cls.max_batch_size == ens.MAX_BATCH
    assert built.backend == ("python" if triton_server.find_server(local=True).kind == "wheel" else "onnxruntime")
    bad = ens.ensemble_config("broken_service")
    steps = bad["ensemble_scheduling"]["step"]
    steps[1]["input_map"] = {"INPUT__0": "pixles"}  # a wrong input name and a misspelt tensor
    steps[2]["output_map"] = {"TOP": ens.LABELS}
    with pytest.raises(triton_repo.ConfigError) as err:
        ens.write_ensemble(built.path, bad)
    text = str(err.value)
    assert "'INPUT__0' is not an input of digits_classifier" in text and "'pixles' is read before" in text
    assert "input 'input' is not mapped" in text and "'TOP' is not an output" in text
    assert "'SCORES' is produced by no step" in text
    assert not (built.path / "broken_service").exists()
    # the NGC server's form of the classifier (Triton's onnxruntime backend, on a GPU) is valid as well
    ngc = ens.classifier_config(backend="onnxruntime", gpus=1, instances=2)
    assert triton_repo.validate_config(ngc, gpus=1).platform == "onnxruntime_onnx"
    with pytest.raises(triton_repo.ConfigError, match="respons_cache"):  # the schema names a misspelt field
        triton_repo.parse_config({**ens.ensemble_config(), "respons_cache": {"enable": True}})


def test_accuracy_through_the_service_over_http_and_grpc(built, server):
    # different batch sizes: different requests, so the second protocol is not answered from the cache
    http = ens.service_accuracy(server.http_url, protocol="http", batch_size=16)
    grpc = ens.service_accuracy(server.grpc_url, protocol="grpc", batch_size=7)
    assert http["images"] == grpc["images"] == 357
    assert http["accuracy"] > 0.9 and grpc["accuracy"] > 0.9, (http, grpc)
    # the PNG round trip and the preprocessing reproduce training's input: the same answers as in-process
    assert abs(http["accuracy"] - built.facts["accuracy"]) < 0.01 and http["wrong"] == grpc["wrong"]
    # the preprocessing model alone: the PNGs come back as the normalized tensors the CNN was trained on
    pngs, y = ens.digits_pngs("test", 40)
    x = triton_client.infer(server.http_url, ens.PREPROCESS, {ens.IMAGE: ens.image_batch(pngs)},
                            protocol="http")[ens.PIXELS]
    assert x.shape == (40, 1, 8, 8) and np.abs(x - digits_arrays()["x_test"][:40]).max() < 0.02
    pngs = pngs[:3]
    labels, scores = ens.classify(server.grpc_url, pngs)
    assert len(labels) == 3 and all(len(row) == ens.TOP_K for row in labels) and scores.shape == (3, ens.TOP_K)
    assert np.all(np.diff(scores, axis=1) <= 0) and np.all(scores.sum(axis=1) <= 1.0 + 1e-5)
    assert all(set(row) <= set(ens.DIGIT_LABELS) and len(set(row)) == ens.TOP_K for row in labels)


def _png(size: tuple[int, int], noise: bool = False) -> bytes:
    """A grey PNG of ``size`` (w, h) px: black (a few hundred bytes at any size) or noise (incompressible)."""
    from PIL import Image

    img = Image.new("L", size)
    if noise:
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, size[::-1], dtype=np.uint8), mode="L")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _status(url: str, protocol: str, array: np.ndarray) -> tuple[str, str]:
    """(status, message) of one request sent with tritonclient itself: the HTTP code or the gRPC status."""
    from tritonclient.utils import InferenceServerException

    mod = triton_client._module(protocol)
    c = mod.InferenceServerClient(triton_client.host_port(url))
    try:
        ins, _ = triton_client.build_request(mod, protocol, {ens.IMAGE: array}, None)
        c.infer(ens.SERVICE, ins)
    except InferenceServerException as err:
        return str(err.status()), str(err.message())
    finally:
        c.close()
    return "ok", ""


@functools.cache
def _bad() -> dict[str, tuple[bytes, list[str]]]:
    """What a client sends -> words the error must hold (the problem and the fix). Built on first use, not at
    import: every worker collects this module, and the 15-Mpx PNG and the photographs cost a second of CPU."""
    return {
        "not an image": (b"hello, this is text", ["not an image file", "send the encoded file"]),
        "truncated PNG header": (_png((32, 32))[:40], ["start like a PNG file", "send the complete file"]),
        "truncated PNG data": (_png((64, 64), noise=True)[:2000], ["corrupt or truncated", "send the complete file"]),
        "oversized bytes": (b"\x89PNG" + bytes(ens.MAX_IMAGE_BYTES), ["over this service's limit", "8 MiB",
                                                                       "smaller file"]),
        "oversized image": (_png((5000, 3000)), ["5000x3000 px, 15.0 Mpx", "limit of 12.6 Mpx", "resize it"]),
        "a 1x1 image": (_png((1, 1)), ["1x1 px", "under this service's minimum of 8 px"]),
        "decompression bomb": (ens.decompression_bomb(), ["px, over this service's limit", "resize it"]),
        "truncated JPEG": (ens.photo_jpegs(1)[0][:5000], ["JPEG", "corrupt or truncated", "send the complete file"]),
    }


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_input_is_a_400_naming_the_fix_and_the_server_stays_healthy(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    want = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    good, _ = ens.digits_pngs("train", 2)
    for what, (payload, words) in _bad().items():
        status, message = _status(url, protocol, ens.image_batch([good[0], payload]))
        assert status == want, (what, status, message)
        assert all(w in message for w in words) and "IMAGE[1]" in message, (what, message)
    status, message = _status(url, protocol, np.zeros((1, 1), np.float32))  # wrong dtype: refused by Triton itself
    assert status == want and "data-type is 'FP32'" in message and "expects 'BYTES'" in message, message
    # bad and good requests at once: each bad one fails alone, the others in the same batch are answered
    payloads = [[good[0]], [_bad()["not an image"][0]], [good[1]], [_bad()["oversized image"][0]]]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _status(url, protocol, ens.image_batch(p)), payloads))
    assert [r[0] for r in results] == ["ok", want, "ok", want], results
    assert server.alive() and server.ready() and triton_client.model_ready(url, ens.PREPROCESS, protocol)
    assert "not healthy" not in server.log_tail(400) and "terminate called" not in server.log_tail(400)
    assert ens.classify(url, good[:1], protocol=protocol)[0][0][0] in ens.DIGIT_LABELS


def _backend_module(vdir: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A python-backend model.py of a built repository, imported here as the stub imports it."""
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(str(vdir))  # model.py imports nvlab_triton_model from its folder, as in the stub
    spec = importlib.util.spec_from_file_location(name, vdir / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules.pop("nvlab_triton_model", None)  # that folder's copy: no other test should import it by name
    return mod


def test_nothing_decodes_before_the_size_is_checked(built, monkeypatch):
    """The preprocessing model refuses a decompression bomb (13 KB declaring 110 Mpixels) and an oversized body from
    what it knows before decoding: with Pillow's decoder replaced by a trap, the refusals are the size ones."""
    import json

    from PIL import ImageFile

    mod = _backend_module(built.path / ens.PREPROCESS / "1", "nvlab_preprocess_test", monkeypatch)
    model = mod.TritonPythonModel()
    params = {"image_size": "8", "max_image_bytes": str(ens.MAX_IMAGE_BYTES),
              "max_image_pixels": str(ens.MAX_IMAGE_PIXELS)}
    model.initialize({"model_config": json.dumps({
        "input": [{"name": ens.IMAGE}], "output": [{"name": ens.PIXELS}],
        "parameters": {k: {"string_value": v} for k, v in params.items()}}),
        "model_repository": str(built.path / ens.PREPROCESS), "model_version": "1"})  # as the stub passes them
    photo = ens.photo_jpegs(1, (300, 300))[0]
    assert model.decode(0, photo).shape == (1, 8, 8)  # a real JPEG decodes (before the trap)

    def trap(self, *a, **k):
        raise AssertionError("decoded before the size was checked")

    monkeypatch.setattr(ImageFile.ImageFile, "load", trap)
    with pytest.raises(mod.BadImage, match=r"IMAGE\[0\] is \d+x\d+ px, 110.0 Mpx, over this service's limit of "
                                           r"12.6 Mpx"):
        model.decode(0, ens.decompression_bomb())
    with pytest.raises(mod.BadImage, match="over this service's limit of"):
        model.decode(0, photo + bytes(ens.MAX_IMAGE_BYTES))


def _jpeg(img: Any, orientation: int | None = None, quality: int = 100) -> bytes:
    """``img`` as a JPEG, with an EXIF Orientation tag when ``orientation`` is given."""
    from PIL import Image

    buf = io.BytesIO()
    extra = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        extra["exif"] = exif.tobytes()
    img.save(buf, format="JPEG", quality=quality, **extra)
    return buf.getvalue()


def _stored(img: Any, orientation: int) -> Any:
    """``img`` (upright) as a camera stores it under EXIF ``orientation``: the inverse of exif_transpose's turn."""
    from PIL import Image

    t = Image.Transpose
    return img.transpose({2: t.FLIP_LEFT_RIGHT, 3: t.ROTATE_180, 4: t.FLIP_TOP_BOTTOM, 5: t.TRANSPOSE,
                          6: t.ROTATE_90, 7: t.TRANSVERSE, 8: t.ROTATE_270}[orientation])


def _upright_digits(n: int = 3) -> tuple[list[Any], list[str]]:
    """``n`` held-out digits with no mirror symmetry (2, 4, 7) as upright 32x32 grey Pillow images, and labels."""
    from PIL import Image

    pngs, y = ens.digits_pngs("test", 60)
    picked = [k for k in range(len(y)) if int(y[k]) in (2, 4, 7)][:n]
    return [Image.open(io.BytesIO(pngs[k])).convert("L") for k in picked], [str(int(y[k])) for k in picked]


def test_exif_oriented_jpegs_are_served_upright(server):
    """A JPEG stored sideways (or mirrored) with its EXIF Orientation tag, as a phone stores a photo held upright,
    reaches the classifier as the upright image: for each of the 7 turned orientations the preprocessed tensor
    matches the upright JPEG's (JPEG's own rounding apart), and the top-1 label is the upright one's. The same files
    without the tag differ by far more: the check can tell a turned image."""
    digits, _ = _upright_digits()
    for up in digits:
        items = [_jpeg(up)] + [_jpeg(_stored(up, o), o) for o in range(2, 9)]
        untagged = [_jpeg(_stored(up, o)) for o in range(2, 9)]
        x = triton_client.infer(server.http_url, ens.PREPROCESS, {ens.IMAGE: ens.image_batch(items + untagged)},
                                protocol="http")[ens.PIXELS]
        turned = np.abs(x[1:8] - x[0]).max(axis=(1, 2, 3))
        sideways = np.abs(x[8:] - x[0]).max(axis=(1, 2, 3))
        assert turned.max() < 0.1, turned  # in the digits' 0..16 units, normalized
        assert sideways.min() > 1.0, sideways
        labels, _ = ens.classify(server.grpc_url, items)
        assert [row[0] for row in labels] == [labels[0][0]] * len(items), labels


def test_16_bit_pngs_are_served_as_their_8_bit_reference(server):
    """A 16-bit grey PNG (Pillow's mode I;16) maps to 8 bits by its high byte (>> 8), not by clipping at 255: its
    tensor and top-k equal those of the 8-bit PNG of the same picture, whatever the low byte holds."""
    from PIL import Image

    digits, _ = _upright_digits()
    rng = np.random.default_rng(0)
    items = []
    for up in digits:
        a = np.asarray(up, np.uint16)
        wide = Image.fromarray((a << 8) | rng.integers(0, 256, a.shape, dtype=np.uint16))
        assert wide.mode == "I;16"
        buf = io.BytesIO()
        wide.save(buf, format="PNG")
        items += [_png_of(up), buf.getvalue()]
    x = triton_client.infer(server.http_url, ens.PREPROCESS, {ens.IMAGE: ens.image_batch(items)},
                            protocol="http")[ens.PIXELS]
    assert np.abs(x[1::2] - x[0::2]).max() < 1e-6
    labels, scores = ens.classify(server.http_url, items, protocol="http")
    assert labels[1::2] == labels[0::2] and np.allclose(scores[1::2], scores[0::2], atol=1e-6)


def _png_of(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _random_pngs(n: int, size: int) -> list[bytes]:
    """``n`` random RGB PNGs of ``size`` px (incompressible: a few tens of KB each)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [_png_of(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))) for _ in range(n)]


def test_phone_photos_up_to_12_megapixels_are_answered(server):
    """A 1920x1080 and a 4000x3000 (12 Mpx) JPEG photo are classified (both were refused under the old 256 KiB /
    1024 px limits)."""
    photos = ens.photo_jpegs(1, shape=(1920, 1080)) + ens.photo_jpegs(1, shape=(4000, 3000), seed=1)
    assert len(photos[1]) > 256 * 1024
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        labels, _ = ens.classify(url, photos, protocol=protocol)
        assert len(labels) == 2 and all(row[0] in ens.DIGIT_LABELS for row in labels)


def test_a_large_jpeg_decodes_at_reduced_scale_like_the_full_decode(built, monkeypatch):
    """A 4000x3000 JPEG is decoded at 1/8 scale in the DCT (500x375 px: 1/64 of the pixels) for the 8 px model,
    and its tensor matches the full decode's within 2 grey levels of 255 (pixel_scale 1, no normalization)."""
    import json

    from PIL import Image, ImageFile

    mod = _backend_module(built.path / ens.PREPROCESS / "1", "nvlab_preprocess_draft_test", monkeypatch)
    model = mod.TritonPythonModel()
    model.initialize({"model_config": json.dumps({
        "input": [{"name": ens.IMAGE}], "output": [{"name": ens.PIXELS}],
        "parameters": {"image_size": {"string_value": "8"}}}),
        "model_repository": str(built.path / ens.PREPROCESS), "model_version": "1"})
    photo = ens.photo_jpegs(1, shape=(4000, 3000), seed=2)[0]
    full = Image.open(io.BytesIO(photo)).convert("L").resize((8, 8), Image.Resampling.BOX)
    want = (np.asarray(full, np.float32)[None] * model.scale - model.mean) / model.std
    sizes = []
    load = ImageFile.ImageFile.load

    def recording(self, *a, **k):
        sizes.append(self.size)
        return load(self, *a, **k)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording)
    got = model.decode(0, photo)
    assert sizes and sizes[0] == (500, 375), sizes
    assert got.shape == (1, 8, 8) and np.abs(got - want).max() <= 2, np.abs(got - want).max()  # grey levels


def test_gpu_orientation_matches_pillows_exif_transpose(built, monkeypatch):
    """``upright`` (the GPU path's turn of a decoded tensor: nvJPEG ignores the tag) does what
    ``ImageOps.exif_transpose`` does on the CPU, for all 8 EXIF orientations, on a non-square image; and
    ``GpuImages`` serves an EXIF-turned JPEG as the CPU path does."""
    import json

    import torch
    from PIL import Image, ImageOps

    mod = _backend_module(built.path / ens.PREPROCESS / "1", "nvlab_preprocess_orient_test", monkeypatch)
    a = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG", exif=exif.tobytes())
        img = Image.open(io.BytesIO(buf.getvalue()))
        assert mod.orientation(img) == o
        want = np.asarray(ImageOps.exif_transpose(img))
        got = mod.upright(torch.from_numpy(a).permute(2, 0, 1), o).permute(1, 2, 0).numpy()
        assert np.array_equal(got, want), o
    model = mod.TritonPythonModel()
    params = {"image_size": "64", "channels": "3", "pixel_scale": repr(1 / 255), "resample": "bilinear"}
    model.initialize({"model_config": json.dumps({
        "max_batch_size": 8, "input": [{"name": ens.IMAGE}], "output": [{"name": ens.PIXELS}],
        "parameters": {k: {"string_value": v} for k, v in params.items()}}),
        "model_repository": str(built.path / ens.PREPROCESS), "model_version": "1"})
    gpu = mod.GpuImages("cpu", 64, 3, 1 / 255, model.mean, model.std, "bilinear", max_rows=8,
                        decode_jpeg=_pillow_decode_jpeg, read_mode=None)
    photo = Image.open(io.BytesIO(ens.photo_jpegs(1, (120, 200), seed=4)[0]))
    items = [_jpeg(photo, quality=95)] + [_jpeg(_stored(photo, o), o, quality=95) for o in (3, 6, 8)]
    out = gpu.decode_requests([[(i, d, model.open_checked(i, d)) for i, d in enumerate(items)]], model.pixels)[0]
    want = np.stack([model.decode(i, d) for i, d in enumerate(items)])
    assert float(np.abs(out - want).mean()) < 0.02
    assert float(np.abs(out[1:] - out[0]).mean()) < 0.05  # each upright again


def test_cache_hits_rise_on_repeated_images(server):
    lib = ens.cache_library(server.source)
    if lib is None:
        pytest.skip(f"this Triton build ({server.source}) has no caches/local/libtritoncache_local.so: no response "
                    "cache to measure")
    assert "--cache-config=local" in " ".join(server.argv)
    png = ens.encode_png(np.arange(64, dtype=np.float32).reshape(8, 8) % 17)  # an image no other test sends
    before = ens.cache_stats(server.metrics_url)
    first = ens.classify(server.http_url, [png], protocol="http")
    for _ in range(3):
        again = ens.classify(server.grpc_url, [png])  # the cache key is the request, not the protocol
        assert again[0] == first[0] and np.array_equal(again[1], first[1])
    after = ens.cache_stats(server.metrics_url)
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 3, (before, after)
    assert after["hit_us"] > before["hit_us"] and 0 < after["hit_ratio"] < 1


def test_broken_version_refused_at_load_and_version_1_serves(built, server):
    pngs, _ = ens.digits_pngs("train", 5)
    before = ens.classify(server.grpc_url, pngs)
    vdir = ens.write_broken_version(built.path, 2)
    try:
        with pytest.raises(RuntimeError) as err:  # the default policy serves the latest version: 2
            triton_client.load_model(server.grpc_url, ens.CLASSIFIER)
        text = str(err.value)
        assert "version 2" in text and "[-1, 9]" in text and "dims [10]" in text, text
        states = ens.version_states(server.grpc_url)
        assert states["1"] == "READY" and states["2"].startswith("UNAVAILABLE"), states
        x = np.zeros((2, 1, 8, 8), np.float32)
        assert triton_client.infer(server.http_url, ens.CLASSIFIER, {ens.ONNX_INPUT: x},
                                   protocol="http")[ens.ONNX_OUTPUT].shape == (2, 10)
        after = ens.classify(server.http_url, pngs, protocol="http")
        assert after[0] == before[0]
    finally:
        shutil.rmtree(vdir)


def test_version_2_hot_update_and_the_stale_ensemble_cache(built, server):
    """Version 2 loads beside 1, then alone. The ensemble's cache keeps version 1's answers for images it holds:
    its entries are keyed by the ensemble, not by the classifier behind it (what the lab's hot update must show)."""
    pngs, y = ens.digits_pngs("train", 40)
    cached = ens.classify(server.grpc_url, pngs[:1])  # cached, answered by version 1
    facts = ens.write_classifier_version(built.path, 2, epochs=6, seed=1)
    assert facts["accuracy"] > 0.9 and facts["version"] == 2
    try:
        ens.set_served_versions(built.path, [1, 2])
        triton_client.load_model(server.grpc_url, ens.CLASSIFIER)
        assert ens.version_states(server.grpc_url) == {"1": "READY", "2": "READY"}
        x = triton_client.infer(server.grpc_url, ens.PREPROCESS, {ens.IMAGE: ens.image_batch(pngs[:8])})[ens.PIXELS]
        v1, v2 = (triton_client.infer(server.grpc_url, ens.CLASSIFIER, {ens.ONNX_INPUT: x}, version=v)[ens.ONNX_OUTPUT]
                  for v in ("1", "2"))
        assert not np.allclose(v1, v2) and np.mean(v2.argmax(1) == y[:8]) > 0.8
        ens.set_served_versions(built.path, [2])
        triton_client.load_model(server.grpc_url, ens.CLASSIFIER)
        assert ens.version_states(server.grpc_url).get("2") == "READY"
        fresh = ens.classify(server.http_url, pngs[1:], protocol="http")  # not cached: version 2 answers
        assert np.mean([row[0] == str(t) for row, t in zip(fresh[0], y[1:], strict=True)]) > 0.9
        again = ens.classify(server.grpc_url, pngs[:1])
        assert np.array_equal(again[1], cached[1]), "the cached image is still answered by version 1"
    finally:
        ens.set_served_versions(built.path, None)
        shutil.rmtree(built.path / ens.CLASSIFIER / "2", ignore_errors=True)


def test_resnet50_variant_serves_pngs_and_jpeg_photographs(built, server):
    """The ResNet-50 service's path (RGB, bilinear resize, ImageNet normalization, 1000 labels) at the CPU's small
    size, width 16 and 64 px, on the torch engine the GPU run uses (the GPU run builds width 64 at 224 px; lab 07's
    CPU tier serves the ONNX Runtime variant). Lab 07's variants: one export, its model.pt copied into the next
    variant's classifier, which serves. Random weights: speed only."""
    first = ens.build_resnet50_service(built.path, prefix="resnet50_t1", width=16, image_size=64,
                                       source=server.source, classifier_engine="torch")
    assert "random weights, speed only" in first.note and first.facts["params_m"] < 3
    with pytest.raises(ValueError, match="only a torch-engine variant has a model.pt"):
        ens.build_resnet50_service(built.path, prefix="resnet50_again", width=16, image_size=64,
                                   exported=dataclasses.replace(first, engine="onnxruntime"))
    svc = ens.build_resnet50_service(built.path, prefix="resnet50_t2", width=16, image_size=64,
                                     source=server.source, classifier_engine="torch", exported=first)
    pt = [r.path / r.classifier / "1" / ens.TORCH_FILE for r in (first, svc)]
    assert pt[0].read_bytes() == pt[1].read_bytes() and not (pt[1].parent / "model.onnx").exists()
    assert svc.facts["params_m"] == first.facts["params_m"] and svc.note == first.note
    triton_client.load_model(server.grpc_url, svc.service)  # the copy serves: one ResNet loaded, not two
    labels, scores = ens.classify(server.grpc_url, _random_pngs(3, 64), model=svc.service)
    assert scores.shape == (3, 5) and all(label.startswith("class_") for row in labels for label in row)
    grey, _ = ens.digits_pngs("test", 1)  # grey 32 px: converted to RGB and resized like any other image
    assert len(ens.classify(server.http_url, grey, protocol="http", model=svc.service)[0][0]) == 5
    photos = ens.photo_jpegs(4)  # JPEG photographs of 224-512 px, a few tens of KB each
    assert all(10_000 < len(p) < 100_000 for p in photos) and len(set(photos)) == 4
    assert ens.classify(server.grpc_url, photos, model=svc.service)[1].shape == (4, 5)
    triton_client.unload_model(server.grpc_url, svc.service)


def test_stop_leaves_nothing(server):
    pid, prefix = server.pid, server._shm_prefix
    stubs = [p for p in procs.group_members(pid) if p != pid]
    assert len(stubs) >= 3, "one stub per python model instance"
    server.stop()
    assert not server.alive() and server not in triton_server.running_servers()
    assert not procs.group_members(pid)
    assert not list(Path("/dev/shm").glob(f"{prefix}*"))
    assert server.stop() == server.exit_code  # twice is fine


def test_missing_stub_env_names_the_command(monkeypatch, tmp_path):
    wheel = triton_server.ServerSource("wheel", "/x/bin/tritonserver")
    ngc = triton_server.ServerSource("path", "/opt/tritonserver/bin/tritonserver")
    monkeypatch.setattr(numpy1_env, "default_stub_env", lambda: tmp_path / "env")
    monkeypatch.setattr(numpy1_env.np, "__version__", "2.4.6")
    needed = numpy1_env.stub_env_needed
    assert needed(wheel) and not needed(ngc) and not needed(None)
    assert numpy1_env.stub_env(ngc) is None  # the NGC image's stub matches its own NumPy
    with pytest.raises(RuntimeError, match=r"nvlab stub-env") as err:
        numpy1_env.stub_env(wheel)
    assert "TYPE_STRING" in str(err.value) and str(tmp_path / "env") in str(err.value)
    monkeypatch.setattr(numpy1_env.np, "__version__", "1.26.4")
    assert numpy1_env.stub_env(wheel) is None


# --- the torch engine (the GPU path, forced onto the CPU here) --------------------------------------------

ONNX_SERVICE, ONNX_CLASSIFIER = "digits_onnx_service", "digits_onnx_classifier"


def test_engine_defaults_torch_with_a_gpu_and_onnx_without():
    gpu = ens.classifier_config(backend="python", gpus=1, instances=2)
    assert gpu["instance_group"] == [{"kind": "KIND_GPU", "count": 2}]
    assert gpu["parameters"]["engine"]["string_value"] == "torch"
    assert gpu["parameters"]["precision"]["string_value"] == "fp32"  # as exported: the ONNX path's answers
    assert triton_repo.validate_config(gpu, gpus=1).backend == "python"
    assert ens.classifier_config()["parameters"]["engine"]["string_value"] == "onnxruntime"
    assert ens.resolve_engine(None, "onnxruntime", gpus=1) == "onnxruntime"  # the NGC server: ORT's own GPU path
    half = ens.classifier_config(engine="torch", precision="bf16")
    assert half["parameters"]["precision"]["string_value"] == "bf16"
    with pytest.raises(ValueError, match="backend='python'"):
        ens.resolve_engine("torch", "onnxruntime")
    with pytest.raises(ValueError, match="use one of"):
        ens.classifier_config(engine="tensorrt")
    with pytest.raises(ValueError, match="give engine='torch'"):
        ens.classifier_config(engine="onnxruntime", precision="fp16")


def test_a_trace_that_froze_the_batch_is_refused_at_export(tmp_path):
    """``export_torchscript`` traces without torch's own re-trace check (most of the tracing time); its comparison
    with the model at another batch size is what refuses a forward that froze the batch size into the trace."""
    import torch

    from lab_utils.serving import ensemble_models

    class Frozen(torch.nn.Module):
        def forward(self, x):
            return x.reshape(int(x.shape[0]), -1)[:, :10]  # int(): the traced batch (2) becomes a constant

    with pytest.raises(RuntimeError, match=r"answers a batch of 3 differently from the model \(shape \(2, 10\) vs \(3"):
        ensemble_models.export_torchscript(Frozen(), tmp_path)
    assert not (tmp_path / ens.TORCH_FILE).exists()
    assert ensemble_models.export_torchscript(torch.nn.Flatten(), tmp_path).is_file()  # a shape-generic one is kept


@pytest.fixture(scope="module")
def torch_built(tmp_path_factory):
    """The digits service with the torch engine forced on the CPU, and beside it the same model.onnx behind the
    ONNX path (``digits_onnx_service``): one training, so the two paths hold the same weights."""
    source = require_server()
    try:
        numpy1_env.stub_env(source, build=True)
    except (RuntimeError, OSError) as err:
        if env_flag(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but the python backend's environment cannot be built: {err}")
        pytest.skip(f"the python backend's NumPy-1 environment is not built and cannot be: {err}")
    svc = ens.build_service_repository(tmp_path_factory.mktemp("lab07-torch") / "repo", source=source,
                                       classifier_engine="torch", gpus=0, instances=1, cache=None)
    onnx_dir = svc.path / ONNX_CLASSIFIER
    (onnx_dir / "1").mkdir(parents=True)
    for f in (svc.path / ens.CLASSIFIER / "1").glob("model.onnx*"):  # with its external data, if any
        shutil.copy(f, onnx_dir / "1" / f.name)
    ens._write_python_files(onnx_dir / "1", "onnx_classifier")
    triton_repo.write_config(onnx_dir, ens.classifier_config(ONNX_CLASSIFIER, engine="onnxruntime"), gpus=0)
    ens.write_ensemble(svc.path, ens.ensemble_config(ONNX_SERVICE, classifier=ONNX_CLASSIFIER, cache=False))
    return svc


@pytest.fixture(scope="module")
def torch_server(torch_built):
    kwargs = {**torch_built.server_kwargs(None), "load_models": (torch_built.service, ONNX_SERVICE)}
    with TritonServer(torch_built.path, stop_grace_s=0.3, **kwargs) as s:
        yield s


def test_torch_engine_exports_torchscript_beside_onnx(torch_built):
    vdir = torch_built.path / ens.CLASSIFIER / "1"
    assert torch_built.engine == "torch" and torch_built.backend == "python"
    assert (vdir / ens.TORCH_FILE).is_file() and (vdir / "model.onnx").is_file()
    assert "run by torch" in (vdir / "model.py").read_text()
    cfg = triton_repo.parse_config((vdir.parent / "config.pbtxt").read_text())
    group = cfg.instance_group[0]
    assert cfg.parameters["engine"].string_value == "torch" and group.kind == group.KIND_CPU


def test_torch_engine_answers_as_the_onnx_path(torch_built, torch_server):
    """Held-out digits through both services on one server: the same top-k labels and scores (FP32 both ways),
    and the classifiers' logits equal ONNX Runtime's in-process on the same model.onnx."""
    import onnxruntime as ort

    pngs, y = ens.digits_pngs("test")
    url = torch_server.grpc_url
    got_t, got_o = [], []
    for i in range(0, len(pngs), 32):
        got_t.append(ens.classify(url, pngs[i:i + 32], model=torch_built.service))
        got_o.append(ens.classify(torch_server.http_url, pngs[i:i + 32], protocol="http", model=ONNX_SERVICE))
    labels_t = [row for lab, _ in got_t for row in lab]
    labels_o = [row for lab, _ in got_o for row in lab]
    scores_t, scores_o = np.concatenate([s for _, s in got_t]), np.concatenate([s for _, s in got_o])
    assert len(labels_t) == 357 and labels_t == labels_o
    assert np.abs(scores_t - scores_o).max() < 1e-5
    acc = np.mean([row[0] == str(int(t)) for row, t in zip(labels_t, y, strict=True)])
    assert acc > 0.9 and abs(acc - torch_built.facts["accuracy"]) < 0.01
    # the classifier alone: same names, dtype and shapes as the ONNX path
    x = triton_client.infer(url, ens.PREPROCESS, {ens.IMAGE: ens.image_batch(pngs[:40])})[ens.PIXELS]
    lt = triton_client.infer(url, ens.CLASSIFIER, {ens.ONNX_INPUT: x})[ens.ONNX_OUTPUT]
    lo = triton_client.infer(url, ONNX_CLASSIFIER, {ens.ONNX_INPUT: x})[ens.ONNX_OUTPUT]
    sess = ort.InferenceSession(str(torch_built.path / ens.CLASSIFIER / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    ref = sess.run(None, {ens.ONNX_INPUT: x})[0]
    assert lt.dtype == lo.dtype == np.float32 and lt.shape == lo.shape == (40, 10)
    assert np.abs(lt - lo).max() < 1e-4 and np.abs(lt - ref).max() < 1e-4
    assert (lt.argmax(1) == y[:40]).mean() > 0.9


def test_torch_engine_refuses_a_broken_version_at_load(torch_built, torch_server):
    vdir = ens.write_broken_version(torch_built.path, 2)
    try:
        assert (vdir / ens.TORCH_FILE).is_file() and "run by torch" in (vdir / "model.py").read_text()
        with pytest.raises(RuntimeError) as err:
            triton_client.load_model(torch_server.grpc_url, ens.CLASSIFIER)
        text = str(err.value)
        assert "version 2" in text and "[-1, 9]" in text and "dims [10]" in text, text
        assert ens.version_states(torch_server.grpc_url)["1"] == "READY"
        assert ens.classify(torch_server.grpc_url, ens.digits_pngs("test", 2)[0],
                            model=torch_built.service)[0][0][0] in ens.DIGIT_LABELS
    finally:
        shutil.rmtree(vdir)


def test_torch_engine_on_a_gpu_instance_without_a_gpu_names_the_fix(torch_built, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the no-GPU error cannot show")
    vdir = torch_built.path / ens.CLASSIFIER / "1"
    mod = _backend_module(vdir, "nvlab_torch_classifier_test", monkeypatch)
    with pytest.raises(RuntimeError, match=r"GPU instance \(cuda:0\).*sees no GPU.*gpus=0"):
        mod.TorchClassifier(vdir / ens.TORCH_FILE, "cuda:0")
    with pytest.raises(ValueError, match="precision='fp8'"):
        mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu", precision="fp8")
    cpu = mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu", precision="bf16")  # autocast: close, not equal
    x = digits_arrays()["x_test"][:16].astype(np.float32)
    y = cpu(x)
    assert y.dtype == np.float32 and y.shape == (16, 10)
    assert (y.argmax(1) == mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu")(x).argmax(1)).mean() > 0.8


# --- the GPU path's pieces, run on the CPU ------------------------------------------------------------------


calls: list[int] = []  # how many images each call of the decoder below received


def _pillow_decode_jpeg(data, mode=None, device="cpu"):
    """Lab 07's Pillow stand-in for torchvision's ``decode_jpeg``, counting each call's images and refusing what the
    test marks, so the GPU preprocessing's batching, resizing and normalization run without torchvision or a GPU."""
    calls.append(len(data))
    if any(t.numpy()[-3] == 0x42 for t in data):  # a marker the test plants: what nvJPEG refuses
        raise RuntimeError("nvjpegDecodeBatched failed")
    return lab07.decode_jpeg(data, mode, device)


def test_gpu_preprocessing_batches_resizes_and_normalizes_like_pillow(built, monkeypatch):
    """``GpuImages`` (the KIND_GPU preprocessing): a batch's complete JPEGs in ONE decode call, resized and normalized
    to what the CPU path gives (mean difference < 0.02 of a normalized unit: torch's antialiased bilinear against
    Pillow's); a PNG and a JPEG the decoder refuses go through Pillow; a truncated JPEG (no end marker) is refused
    by Pillow for its own request while the others are answered."""
    import json

    mod = _backend_module(built.path / ens.PREPROCESS / "1", "nvlab_preprocess_gpu_test", monkeypatch)
    model = mod.TritonPythonModel()
    params = {"image_size": "64", "channels": "3", "pixel_scale": repr(1 / 255), "mean": "0.485,0.456,0.406",
              "std": "0.229,0.224,0.225", "resample": "bilinear", "max_image_bytes": str(ens.MAX_IMAGE_BYTES),
              "max_image_pixels": str(ens.MAX_IMAGE_PIXELS)}
    model.initialize({"model_config": json.dumps({
        "max_batch_size": 8, "input": [{"name": ens.IMAGE}], "output": [{"name": ens.PIXELS}],
        "parameters": {k: {"string_value": v} for k, v in params.items()}}),
        "model_repository": str(built.path / ens.PREPROCESS), "model_version": "1"})
    assert model.gpu is None  # a KIND_CPU instance
    gpu = mod.GpuImages("cpu", 64, 3, 1 / 255, model.mean, model.std, "bilinear", max_rows=2,
                        decode_jpeg=_pillow_decode_jpeg, read_mode=None)
    photos = ens.photo_jpegs(5, (80, 300), seed=3)
    png = _random_pngs(1, 70)[0]
    refused = photos[4][:-3] + b"\x42" + photos[4][-2:]  # still ends with FF D9: the fake decoder refuses it
    truncated = photos[3][: len(photos[3]) // 2]
    assert mod.jpeg_complete(photos[0]) and not mod.jpeg_complete(truncated)
    requests = [[photos[0], photos[1]], [png, photos[2]], [truncated], [refused]]
    results = [[(i, d, model.open_checked(i, d)) for i, d in enumerate(r)] for r in requests]
    calls.clear()
    out = gpu.decode_requests(results, model.pixels)
    assert calls[0] == 4  # one call for the batch's 4 complete JPEGs (it failed on one: then one call each)
    assert calls[1:] == [1] * 4
    assert isinstance(out[2], str) and "corrupt or truncated" in out[2]
    for got, items in zip([out[0], out[1], out[3]], [requests[0], requests[1], requests[3]], strict=True):
        want = np.stack([model.decode(i, d) for i, d in enumerate(items)])
        assert got.shape == want.shape == (len(items), 3, 64, 64) and got.dtype == np.float32
        assert float(np.abs(got - want).mean()) < 0.02
    assert len(gpu.host) >= 5  # the pinned buffer grew past max_rows
    first = gpu.decode_requests(["IMAGE[0] is empty", [(0, photos[0], model.open_checked(0, photos[0]))]], model.pixels)
    assert first[0] == "IMAGE[0] is empty" and first[1].shape == (1, 3, 64, 64)  # an error passes through


def test_classifier_knobs_channels_last_and_cuda_graphs(torch_built, monkeypatch):
    """channels_last runs on the CPU with the same answers; CUDA graphs are refused there with the fix named; the
    configuration carries both, and refuses them off the torch engine or without a GPU."""
    vdir = torch_built.path / ens.CLASSIFIER / "1"
    mod = _backend_module(vdir, "nvlab_torch_knobs_test", monkeypatch)
    assert mod.graph_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and mod.graph_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert mod.graph_sizes(1) == [1]
    x = digits_arrays()["x_test"][:16].astype(np.float32)
    nhwc = mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu", channels_last=True)(x)
    assert np.allclose(nhwc, mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu")(x), atol=1e-4)
    with pytest.raises(ValueError, match=r"cuda_graphs=1 on cpu.*KIND_GPU"):
        mod.TorchClassifier(vdir / ens.TORCH_FILE, "cpu", graphs=(1, 8, 8, 4))
    cfg = ens.classifier_config(engine="torch", gpus=1, precision="bf16", channels_last=True, cuda_graphs=True)
    assert {k: v["string_value"] for k, v in cfg["parameters"].items()} == {
        "engine": "torch", "threads": "1", "precision": "bf16", "channels_last": "1", "cuda_graphs": "1"}
    with pytest.raises(ValueError, match="needs a GPU instance"):
        ens.classifier_config(engine="torch", cuda_graphs=True)
    with pytest.raises(ValueError, match="torch engine's"):
        ens.classifier_config(engine="onnxruntime", channels_last=True)
    pre = ens.preprocess_config(device="gpu", instances=2, queue_delay_us=300)
    assert pre["instance_group"] == [{"kind": "KIND_GPU", "count": 2}]
    assert pre["dynamic_batching"]["max_queue_delay_microseconds"] == 300
    assert triton_repo.validate_config(pre, gpus=1).backend == "python"
    with pytest.raises(ValueError, match="device='tpu'"):
        ens.preprocess_config(device="tpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        ens.build_service(torch_built.path / "x", None, prefix="x", labels=["a"], image_size=8, channels=1,
                          pixel_scale=1.0, mean=(0.0,), std=(1.0,), preprocess_device="gpu",
                          source=triton_server.ServerSource("path", "/x"))
