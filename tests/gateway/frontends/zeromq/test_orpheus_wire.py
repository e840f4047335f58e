"""The client library does not import the server, and the ZeroMQ wire format did not change
when its types moved out of the gateway into ``orpheus_wire``.

The imports are checked in a fresh interpreter (this one has imported the whole server), so
``sys.modules`` holds exactly what ``import orpheus_client.zmq_client`` pulled in. The bytes
were recorded with the types where they lived before (``gateway/frontends/zeromq/protocol.py``
at adaecfd): a client of an older or newer server reads and writes the same messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from orpheus_wire.zeromq import (
    AppendText,
    Audio,
    Cancel,
    Done,
    Error,
    Speak,
    Started,
    client_decoder,
    encoder,
    endpoint_for,
    server_decoder,
)

ROOT = Path(__file__).resolve().parents[4]

SERVER_PACKAGES = ("gateway", "llm_worker", "codec_worker", "orchestrator", "common", "shm")
HEAVY = ("av", "numpy", "torch", "vllm", "aiohttp", "uvloop", "transformers", "snac")


def _top_level_modules_after(statement: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after ``statement``, less the
    standard library's and those the interpreter starts with (site hooks)."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    return {name.split(".")[0] for name in json.loads(res.stdout)} - sys.stdlib_module_names


def _pulled_in_by(statement: str) -> set[str]:
    return _top_level_modules_after(statement) - _top_level_modules_after("pass")


CLIENT_NEEDS = {"orpheus_client", "orpheus_wire", "msgspec", "zmq", "typing_extensions"}
"""And what they bring: msgspec typing_extensions, pyzmq its Cython runtime (``_cython_*``,
``cython_runtime``)."""


def test_importing_the_client_pulls_in_no_server_and_nothing_heavy() -> None:
    pulled = _pulled_in_by("import orpheus_client.zmq_client")
    assert not pulled & set(SERVER_PACKAGES), pulled & set(SERVER_PACKAGES)
    assert not pulled & set(HEAVY), pulled & set(HEAVY)
    extra = {m for m in pulled - CLIENT_NEEDS if not m.startswith(("_cython", "cython_runtime"))}
    assert not extra, f"the client now imports {sorted(extra)}"
    assert {"orpheus_client", "orpheus_wire", "msgspec", "zmq"} <= pulled


def test_the_wire_types_import_only_msgspec() -> None:
    pulled = _pulled_in_by("import orpheus_wire.zeromq, orpheus_wire.sampling")
    assert pulled - {"typing_extensions"} == {"orpheus_wire", "msgspec"}  # msgspec's own


def test_the_check_sees_a_heavy_import() -> None:
    """The fresh interpreter reports what an import pulls in (the test above can fail)."""
    assert {"gateway", "av", "numpy"} <= _pulled_in_by("import gateway.audio.output")


SPEAK_ALL = Speak(
    request_id=7, input="Hi.", voice="tara", model="m", response_format="wav",
    sample_rate=16000, speed=1.5, text_open=True, api_key="k", max_tokens=70, seed=3,
    temperature=0.5, top_p=0.9, repetition_penalty=1.1,
)  # fmt: skip

# Recorded with gateway/frontends/zeromq/protocol.py at adaecfd (before the move); the two
# Speak messages as they are since issue 32 added the sampling field top_k (after the other
# sampling fields: Speak inherits them from orpheus_wire.sampling.SamplingFields) and issue 35
# traceparent, issue 46 language and issue 59 cache (at the end). What an older client sends
# still decodes the same (OLD_SPEAK below: before cache; before language; before issue 34 added
# pronunciation_dictionary_locators and apply_text_normalization, and before top_k and
# traceparent).
GOLDEN = [
    (
        SPEAK_ALL,
        "de0015a474797065a5737065616baa6d61785f746f6b656e7346a47365656403ab74656d70657261"
        "74757265cb3fe0000000000000a5746f705f70cb3feccccccccccccdb272657065746974696f6e5f"
        "70656e616c7479cb3ff199999999999aa5746f705f6bc0aa726571756573745f696407a5696e7075"
        "74a348692ea5766f696365a474617261a56d6f64656ca16daf726573706f6e73655f666f726d6174"
        "a3776176ab73616d706c655f72617465cd3e80a57370656564cb3ff8000000000000a9746578745f"
        "6f70656ec3a76170695f6b6579a16bd92170726f6e756e63696174696f6e5f64696374696f6e6172"
        "795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a6174696f6ec0ab7472"
        "616365706172656e74c0a86c616e6775616765c0a56361636865c0",
    ),
    (
        Speak(request_id=1, input="x"),
        "de0015a474797065a5737065616baa6d61785f746f6b656e73c0a473656564c0ab74656d70657261"
        "74757265c0a5746f705f70c0b272657065746974696f6e5f70656e616c7479c0a5746f705f6bc0aa"
        "726571756573745f696401a5696e707574a178a5766f696365a0a56d6f64656ca0af726573706f6e"
        "73655f666f726d6174a370636dab73616d706c655f72617465c0a57370656564cb3ff00000000000"
        "00a9746578745f6f70656ec2a76170695f6b6579c0d92170726f6e756e63696174696f6e5f646963"
        "74696f6e6172795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a617469"
        "6f6ec0ab7472616365706172656e74c0a86c616e6775616765c0a56361636865c0",
    ),
    (
        AppendText(request_id=7, text="more", final=True),
        "84a474797065a6617070656e64aa726571756573745f696407a474657874a46d6f7265a566696e616cc3",
    ),
    (Cancel(request_id=7), "82a474797065a663616e63656caa726571756573745f696407"),
    (
        Started(
            request_id=7,
            stream_id=2**40 + 5,
            sample_rate=24000,
            response_format="pcm",
            watermark="perth",
        ),
        "87a474797065a773746172746564aa726571756573745f696407a973747265616d5f6964cf000001"
        "0000000005ab73616d706c655f72617465cd5dc0af726573706f6e73655f666f726d6174a370636d"
        "ac61695f67656e657261746564c3a977617465726d61726ba57065727468",
    ),
    (
        Audio(request_id=7, seq=2, data=b"\x00\x01"),
        "84a474797065a5617564696faa726571756573745f696407a373657102a464617461c4020001",
    ),
    (
        Done(request_id=7, reason="stop", audio_seconds=1.25, frames=15),
        "85a474797065a4646f6e65aa726571756573745f696407a6726561736f6ea473746f70ad61756469"
        "6f5f7365636f6e6473cb3ff4000000000000a66672616d65730f",
    ),
    (
        Error(request_id=None, status=400, code="invalid_message", message="bad"),
        "85a474797065a56572726f72aa726571756573745f6964c0a6737461747573cd0190a4636f6465af"
        "696e76616c69645f6d657373616765a76d657373616765a3626164",
    ),
]


OLD_SPEAK = [
    (
        SPEAK_ALL,
        "de0014a474797065a5737065616baa6d61785f746f6b656e7346a47365656403ab74656d70657261"
        "74757265cb3fe0000000000000a5746f705f70cb3feccccccccccccdb272657065746974696f6e5f"
        "70656e616c7479cb3ff199999999999aa5746f705f6bc0aa726571756573745f696407a5696e7075"
        "74a348692ea5766f696365a474617261a56d6f64656ca16daf726573706f6e73655f666f726d6174"
        "a3776176ab73616d706c655f72617465cd3e80a57370656564cb3ff8000000000000a9746578745f"
        "6f70656ec3a76170695f6b6579a16bd92170726f6e756e63696174696f6e5f64696374696f6e6172"
        "795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a6174696f6ec0ab7472"
        "616365706172656e74c0a86c616e6775616765c0",
    ),
    (
        Speak(request_id=1, input="x"),
        "de0014a474797065a5737065616baa6d61785f746f6b656e73c0a473656564c0ab74656d70657261"
        "74757265c0a5746f705f70c0b272657065746974696f6e5f70656e616c7479c0a5746f705f6bc0aa"
        "726571756573745f696401a5696e707574a178a5766f696365a0a56d6f64656ca0af726573706f6e"
        "73655f666f726d6174a370636dab73616d706c655f72617465c0a57370656564cb3ff00000000000"
        "00a9746578745f6f70656ec2a76170695f6b6579c0d92170726f6e756e63696174696f6e5f646963"
        "74696f6e6172795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a617469"
        "6f6ec0ab7472616365706172656e74c0a86c616e6775616765c0",
    ),
    (
        SPEAK_ALL,
        "de0013a474797065a5737065616baa6d61785f746f6b656e7346a47365656403ab74656d70657261"
        "74757265cb3fe0000000000000a5746f705f70cb3feccccccccccccdb272657065746974696f6e5f"
        "70656e616c7479cb3ff199999999999aa5746f705f6bc0aa726571756573745f696407a5696e7075"
        "74a348692ea5766f696365a474617261a56d6f64656ca16daf726573706f6e73655f666f726d6174"
        "a3776176ab73616d706c655f72617465cd3e80a57370656564cb3ff8000000000000a9746578745f"
        "6f70656ec3a76170695f6b6579a16bd92170726f6e756e63696174696f6e5f64696374696f6e6172"
        "795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a6174696f6ec0ab7472"
        "616365706172656e74c0",
    ),
    (
        Speak(request_id=1, input="x"),
        "de0013a474797065a5737065616baa6d61785f746f6b656e73c0a473656564c0ab74656d70657261"
        "74757265c0a5746f705f70c0b272657065746974696f6e5f70656e616c7479c0a5746f705f6bc0aa"
        "726571756573745f696401a5696e707574a178a5766f696365a0a56d6f64656ca0af726573706f6e"
        "73655f666f726d6174a370636dab73616d706c655f72617465c0a57370656564cb3ff00000000000"
        "00a9746578745f6f70656ec2a76170695f6b6579c0d92170726f6e756e63696174696f6e5f646963"
        "74696f6e6172795f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a617469"
        "6f6ec0ab7472616365706172656e74c0",
    ),
    (
        SPEAK_ALL,
        "de0011a474797065a5737065616baa6d61785f746f6b656e7346a47365656403ab74656d70657261"
        "74757265cb3fe0000000000000a5746f705f70cb3feccccccccccccdb272657065746974696f6e5f"
        "70656e616c7479cb3ff199999999999aaa726571756573745f696407a5696e707574a348692ea576"
        "6f696365a474617261a56d6f64656ca16daf726573706f6e73655f666f726d6174a3776176ab7361"
        "6d706c655f72617465cd3e80a57370656564cb3ff8000000000000a9746578745f6f70656ec3a761"
        "70695f6b6579a16bd92170726f6e756e63696174696f6e5f64696374696f6e6172795f6c6f636174"
        "6f7273c0b86170706c795f746578745f6e6f726d616c697a6174696f6ec0",
    ),
    (
        Speak(request_id=1, input="x"),
        "de0011a474797065a5737065616baa6d61785f746f6b656e73c0a473656564c0ab74656d70657261"
        "74757265c0a5746f705f70c0b272657065746974696f6e5f70656e616c7479c0aa72657175657374"
        "5f696401a5696e707574a178a5766f696365a0a56d6f64656ca0af726573706f6e73655f666f726d"
        "6174a370636dab73616d706c655f72617465c0a57370656564cb3ff0000000000000a9746578745f"
        "6f70656ec2a76170695f6b6579c0d92170726f6e756e63696174696f6e5f64696374696f6e617279"
        "5f6c6f6361746f7273c0b86170706c795f746578745f6e6f726d616c697a6174696f6ec0",
    ),
    (
        SPEAK_ALL,
        "8fa474797065a5737065616baa6d61785f746f6b656e7346a47365656403ab74656d706572617475"
        "7265cb3fe0000000000000a5746f705f70cb3feccccccccccccdb272657065746974696f6e5f7065"
        "6e616c7479cb3ff199999999999aaa726571756573745f696407a5696e707574a348692ea5766f69"
        "6365a474617261a56d6f64656ca16daf726573706f6e73655f666f726d6174a3776176ab73616d70"
        "6c655f72617465cd3e80a57370656564cb3ff8000000000000a9746578745f6f70656ec3a7617069"
        "5f6b6579a16b",
    ),
    (
        Speak(request_id=1, input="x"),
        "8fa474797065a5737065616baa6d61785f746f6b656e73c0a473656564c0ab74656d706572617475"
        "7265c0a5746f705f70c0b272657065746974696f6e5f70656e616c7479c0aa726571756573745f69"
        "6401a5696e707574a178a5766f696365a0a56d6f64656ca0af726573706f6e73655f666f726d6174"
        "a370636dab73616d706c655f72617465c0a57370656564cb3ff0000000000000a9746578745f6f70"
        "656ec2a76170695f6b6579c0",
    ),
]


@pytest.mark.parametrize(("msg", "hex_bytes"), GOLDEN, ids=lambda v: type(v).__name__)
def test_the_wire_bytes_are_those_of_before(msg: object, hex_bytes: str) -> None:
    data = bytes.fromhex(hex_bytes)
    assert encoder.encode(msg) == data
    decoder = client_decoder if isinstance(msg, Speak | AppendText | Cancel) else server_decoder
    assert decoder.decode(data) == msg


@pytest.mark.parametrize(
    ("msg", "hex_bytes"),
    OLD_SPEAK,
    ids=["all-46", "minimal-46", "all-35", "minimal-35", "all-34", "minimal-34", "all", "minimal"],
)
def test_an_older_clients_speak_still_decodes(msg: object, hex_bytes: str) -> None:
    assert client_decoder.decode(bytes.fromhex(hex_bytes)) == msg


OLD_STARTED = (
    "85a474797065a773746172746564aa726571756573745f696407a973747265616d5f6964cf000001"
    "0000000005ab73616d706c655f72617465cd5dc0af726573706f6e73655f666f726d6174a370636d"
)
"""``started`` before issue 58 added ``ai_generated`` and ``watermark`` (at the end)."""


def test_started_says_ai_generated_to_new_and_old_clients() -> None:
    """An older server's ``started`` decodes (AI-generated, no watermark: none had one); an
    older client, whose type lacks the two fields, reads a new server's as before."""
    old = server_decoder.decode(bytes.fromhex(OLD_STARTED))
    assert isinstance(old, Started) and old.ai_generated and old.watermark == "none"

    class OldStarted(msgspec.Struct, frozen=True, tag="started", tag_field="type"):
        request_id: int
        stream_id: int
        sample_rate: int
        response_format: str

    new = encoder.encode(Started(7, 2**40 + 5, 24000, "pcm", watermark="perth"))
    assert msgspec.msgpack.decode(new, type=OldStarted) == OldStarted(7, 2**40 + 5, 24000, "pcm")


def test_top_k_travels_in_speak() -> None:
    msg = Speak(request_id=3, input="x", top_k=1)
    assert client_decoder.decode(encoder.encode(msg)).top_k == 1


def test_gateway_process_endpoints() -> None:
    assert endpoint_for("tcp://127.0.0.1:8001", 0) == "tcp://127.0.0.1:8001"
    assert endpoint_for("tcp://127.0.0.1:8001", 2) == "tcp://127.0.0.1:8003"
    assert endpoint_for("ipc:///run/orpheus/zmq", 1) == "ipc:///run/orpheus/zmq-1"


def test_an_error_names_retry_after_only_when_retrying_helps() -> None:
    busy = Error(request_id=3, status=429, code="server_busy", message="full", retry_after_s=1)
    assert server_decoder.decode(encoder.encode(busy)) == busy
    bad = Error(request_id=3, status=400, code="invalid_message", message="bad")
    assert b"retry_after_s" not in encoder.encode(bad)  # an older client's bytes
