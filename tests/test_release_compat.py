"""Images are never sent to an inference replica of the last release, which predates them: tested
against that release's own package, not a stand-in.

The last release is the commit that last changed the v1 contracts baseline (protos/release/v1.binpb;
it released every package at once). Its libs/common and services/inference are exported with
`git archive`, installed aside (`pip --target`, no index) and run as a process with that folder
first on its PYTHONPATH, so that it runs its own primerl_common and its own generated stubs. Then:

- its GetServiceInfo names the release's version and does not list `generate.images`;
- a GenerationInput with an image, sent straight to it, is answered as if the image were not there
  (its stubs drop the unknown field): the hazard the router's gating prevents;
- a router of this tree, with that replica registered, refuses a request with images
  (FAILED_PRECONDITION, CAPABILITY_MISSING, naming the capability) and serves the same request
  without images on it: the contracts hold across versions.
"""

from __future__ import annotations

import asyncio
import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tomllib

import grpc
import pytest
from google.rpc import error_details_pb2

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.images import CAPABILITY_IMAGES
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import eventually, in_process_service
from primerl_launcher.tiny_model import make_tiny_model
from primerl_router.config import RouterConfig
from primerl_router.server import ROUTER_CAPABILITY_IMAGES, build

from .replicas import START_TIMEOUT_S, TOLERANCE, max_difference
from .stack import REPO

pytestmark = pytest.mark.slow

# The v1 contracts baseline: the commit that last changed it is the last release.
RELEASE_BASELINE = "protos/release/v1.binpb"
RELEASE_PATHS = ("libs/common", "services/inference")
REPLICA_ID = "inference-release"
RELEASE_ENV_PREFIX = "PRIMERL_INFERENCE_"
PROMPT = list(range(40, 72))


def git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout


def release_commit() -> str:
    try:
        commit = git("log", "-1", "--format=%H", "--", RELEASE_BASELINE).decode().strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git history to find the last release in: {exc}")
    assert commit, f"no commit changed {RELEASE_BASELINE}"
    return commit


def release_inference_version(commit: str) -> str:
    pyproject = git("show", f"{commit}:services/inference/pyproject.toml").decode()
    return tomllib.loads(pyproject)["project"]["version"]


def install_release(commit: str, root: pathlib.Path) -> pathlib.Path:
    """primerl-common and primerl-inference as `commit` had them, installed into a folder of their
    own without an index (their dependencies are this environment's); returns that folder."""
    source = root / "source"
    archive = git("archive", "--format=tar", commit, *RELEASE_PATHS)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    target = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
    subprocess.run(
        [*pip, "--no-index", "--target", str(target), *(str(source / path) for path in RELEASE_PATHS)],
        check=True,
        capture_output=True,
    )
    return target


def release_replica(site: pathlib.Path, model: pathlib.Path, log_path: pathlib.Path) -> ServiceProcess:
    """The release's `primerl-inference`, configured as its config.py reads flags."""
    port = free_port()
    args = [
        *(sys.executable, "-m", "primerl_inference"),
        *("--server.host=127.0.0.1", f"--server.port={port}", "--server.drain_delay_s=0", "--server.grace_s=1"),
        *(f"--engine.model={model}", "--engine.dtype=float32", "--engine.enforce_eager=true"),
        *("--engine.max_model_len=256", "--engine.max_num_seqs=4", "--engine.kv_cache_gib=0.25"),
        *(f"--replica.id={REPLICA_ID}", "--observability.log_json=false"),
    ]
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    process = ServiceProcess(
        args, port=port, name="primerl-inference (release)", log_path=log_path, env={"PYTHONPATH": python_path}
    )
    # Its config is all on the command line. The release rejects keys it does not know, from the
    # environment too: conftest's PRIMERL_INFERENCE_TLS__MODE (TLS came after it) would stop it.
    for name in [name for name in process.env if name.startswith(RELEASE_ENV_PREFIX)]:
        del process.env[name]
    return process


@pytest.fixture(scope="module")
def release():
    return release_commit()


@pytest.fixture(scope="module")
def old_replica(release, tmp_path_factory):
    """One replica of the release for the whole module (vLLM takes a minute or two to start here)."""
    root = tmp_path_factory.mktemp("release")
    site = install_release(release, root)
    model = make_tiny_model(root / "model", family="qwen3", dtype="float32")
    process = release_replica(site, model, root / "inference.log")
    try:
        asyncio.run(process.start(timeout_s=START_TIMEOUT_S))
        yield process
    finally:
        asyncio.run(process.__aexit__(None, None, None))


def png() -> generation_pb2.ImageData:
    """A real image (a release that took images would have decoded it)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(buffer, format="PNG")
    return generation_pb2.ImageData(data=buffer.getvalue(), mime_type="image/png")


def generation_input(*, images: int = 0, cache_salt: str = "") -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=PROMPT,
        images=[png() for _ in range(images)],
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3),
        stream=generation_pb2.StreamOptions(final_only=True),
        return_prompt_logprobs=True,
        cache_salt=cache_salt,
    )


async def final_output(responses) -> generation_pb2.GenerationOutput:
    outputs = [response.output async for response in responses]
    assert outputs and outputs[-1].finished, outputs
    return outputs[-1]


async def test_the_release_replica_names_its_version_and_does_not_list_images(old_replica, release):
    async with make_channel(old_replica.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        info = (await stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest(), timeout=10)).info
    assert info.service_name == "inference"
    # The release's own package answered, not this tree's (installed in the same environment).
    assert info.package_version == release_inference_version(release)
    assert info.package_version.split(".")[0] == "1"
    assert list(info.api_versions) == ["primerl.inference.v1"]
    assert info.attributes["replica_id"] == REPLICA_ID
    assert CAPABILITY_IMAGES not in info.capabilities, list(info.capabilities)
    # It does list capabilities: the router reads their absence, not a failed call.
    assert "generate.prompt_logprobs" in info.capabilities


async def test_the_release_replica_samples_as_if_an_image_were_not_there(old_replica):
    """Why the router gates: the release takes a request with an image without an error and
    samples from the text alone. Each request has its own cache salt, so each is computed."""
    async with make_channel(old_replica.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def generate(generation: generation_pb2.GenerationInput) -> generation_pb2.GenerationOutput:
            return await final_output(stub.Generate(inference_pb2.GenerateRequest(input=generation), timeout=120))

        with_image = await generate(generation_input(images=1, cache_salt="with-image"))
        text_only = await generate(generation_input(cache_salt="text-only"))
    assert with_image.replica_id == REPLICA_ID
    # No image token was added to the prompt, nothing came from a cache: the same tokens, the
    # same probabilities.
    assert with_image.stats.num_prompt_tokens == text_only.stats.num_prompt_tokens == len(PROMPT)
    assert with_image.stats.num_cached_prompt_tokens == 0
    assert list(with_image.token_ids) == list(text_only.token_ids)
    assert max_difference(list(with_image.logprobs), list(text_only.logprobs)) <= TOLERANCE
    assert max_difference(list(with_image.prompt_logprobs[1:]), list(text_only.prompt_logprobs[1:])) <= TOLERANCE


async def replica_load(address: str) -> generation_pb2.LoadReport:
    async with make_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return (await stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=10)).load


async def test_a_router_of_this_tree_keeps_images_off_the_release_replica_and_text_flows(old_replica):
    config = RouterConfig(
        server={"host": "127.0.0.1", "port": 0, "grace_s": 1},
        health={"interval_s": 0.2, "timeout_s": 1.0},
        load={"report_interval_ms": 50},
        routing={"no_replica_wait_s": 1.0},
    )
    async with in_process_service(await build(config), config, max_attempts=1) as served:
        stub = router_pb2_grpc.RouterServiceStub(served.channel)
        router_info = (await stub.GetServiceInfo(router_pb2.GetServiceInfoRequest())).info
        assert ROUTER_CAPABILITY_IMAGES in router_info.capabilities
        register = router_pb2.RegisterReplicaRequest(replica_id=REPLICA_ID, address=old_replica.address)
        await stub.RegisterReplica(register)

        # The router asks a replica's capabilities before it reads its load reports: once one has
        # arrived, the router knows what the replica takes.
        async def reported() -> bool:
            replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
            return [(r.replica_id, r.load.role) for r in replicas] == [(REPLICA_ID, generation_pb2.REPLICA_ROLE_BOTH)]

        await eventually(reported, timeout_s=30, what="the router has the release replica's load report")

        text = await final_output(stub.Generate(router_pb2.GenerateRequest(input=generation_input()), timeout=120))
        assert text.replica_id == REPLICA_ID and len(text.token_ids) == 4

        before = await replica_load(old_replica.address)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await final_output(stub.Generate(router_pb2.GenerateRequest(input=generation_input(images=1)), timeout=60))
        error = refused.value
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
        assert CAPABILITY_IMAGES in error.details()
        assert f"{REPLICA_ID}: no capability {CAPABILITY_IMAGES}" in error.details()
        details = error_details(error)
        assert [d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo)] == ["CAPABILITY_MISSING"]
        subjects = [
            violation.subject
            for d in details
            if isinstance(d, error_details_pb2.PreconditionFailure)
            for violation in d.violations
        ]
        assert subjects == [CAPABILITY_IMAGES]
        # The replica never saw it.
        assert (await replica_load(old_replica.address)).num_prompt_tokens_total == before.num_prompt_tokens_total

        # The same request without its image is served there again.
        again = await final_output(stub.Generate(router_pb2.GenerateRequest(input=generation_input()), timeout=120))
        assert again.replica_id == REPLICA_ID and len(again.token_ids) == 4
