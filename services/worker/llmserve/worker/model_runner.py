"""ModelRunner: loads the model, owns the KV cache and the request states, executes
one StepPlan at a time."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from llmserve.contract.arith import cdiv
from llmserve.contract.plan import NewRequestData, SampledToken, StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.contract.step_budget import resolve_step_budget
from llmserve.contract.worker_info import WorkerInfo
from llmserve.gguf_checkpoint import quantized_weight_type
from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker import kv_cache as kvc
from llmserve.worker.attention import backend_class, install_backend
from llmserve.worker.config import RunnerConfig
from llmserve.worker.cuda_graphs import DecodeGraphs, capture_sizes
from llmserve.worker.device import dtype_choice, dtype_name, resolve_device
from llmserve.worker.input_batch import PLACEHOLDER, InputBatch, Placeholder, PromptRows, RequestState
from llmserve.worker.launched_step import (DeviceStep, HostIds, LaunchedStep, PendingPromptLogprobs,
                                           must_finish_first)
from llmserve.worker.layers.int8_weight import describe_quantization
from llmserve.worker.distributed import DistInit, init_parallel
from llmserve.worker.models.attribute_binding import bind_registered_attributes
from llmserve.worker.models.cpu_decoder_stack import CpuDecoderStack
from llmserve.worker.models.decoder import DecoderModel, head_dim_of, local_kv_heads, release_window
from llmserve.worker.pipeline import forward_step
from llmserve.worker.models.loader import load_config, load_model
from llmserve.worker.piecewise_graphs import PiecewiseGraphs, token_ladder
from llmserve.worker.sampler import PendingLogprobs, Sampler, SamplingRows, prompt_logprob_tensors
from llmserve.worker.structured_output import Grammars

logger = logging.getLogger(__name__)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def device_facts(device: torch.device) -> tuple[str, int]:
    """What the registration says of `device`: "cpu" or "cuda (<GPU name>)", and its total
    memory in bytes (0 on the CPU)."""
    if device.type != "cuda":
        return "cpu", 0
    return f"cuda ({torch.cuda.get_device_name(device)})", torch.cuda.get_device_properties(device).total_memory


def eos_token_ids(model_dir: Path, config) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids (int or list)."""
    ids = _as_ids(getattr(config, "eos_token_id", None))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


class ModelRunner:
    """One worker rank's engine: the model's weights (or this rank's shard of them), the KV
    cache and its host swap pool, the requests' persistent states (InputBatch) and the
    sampler. `execute` runs one StepPlan: block moves, then the forward and sampling of
    each of its steps; the scheduler decides everything else."""

    def __init__(self, model_dir: Path, settings: RunnerConfig = RunnerConfig(), *, model_name: str | None = None,
                 sampler_seed: int | None = None, dist: DistInit | None = None, model=None):
        """`model`: weights already loaded from `model_dir` with this dtype on one process
        (no parallel group) to share instead of loading them again (benchmarks time
        several KV caches and batches against one copy of the weights)."""
        self.model_dir = Path(model_dir)
        dist = dist or DistInit()
        block_size = self.block_size = settings.block_size
        self.config = load_config(self.model_dir)
        # This rank's device first (a CUDA rank makes cuda:{local_rank} current), then the dtype
        # there (auto: the checkpoint's own on CUDA; on the CPU, device.dtype_choice).
        self.device = resolve_device(settings.device, dist.rank)
        # The step budget the scheduler will resolve from this registration, by the same rule:
        # the profiling forward and the CUDA-graph ladder must size the steps it will send.
        self.device_label, self.device_memory_bytes = device_facts(self.device)
        budget = resolve_step_budget(settings.max_num_batched_tokens, settings.max_num_seqs, self.device_label,
                                     self.device_memory_bytes)
        self.settings = settings = replace(settings, max_num_batched_tokens=budget.max_num_batched_tokens,
                                           max_num_seqs=budget.max_num_seqs)
        self.dtype_choice = dtype_choice(settings.dtype, self.device, self.config, settings.quantization,
                                         quantized_weight_type(self.model_dir))
        self.dtype = self.dtype_choice.dtype
        # `auto` may choose int8 for a checkpoint stored quantized (a GGUF's Q4_1): nothing to keep.
        self.quantization = self.dtype_choice.quantization or settings.quantization
        if settings.dtype == "auto":
            logger.info("dtype %s: %s", dtype_name(self.dtype), self.dtype_choice.reason)
        # TP x PP group: join (the ranks must serve the same model the same way), then
        # build this rank's shard only. A world of 1 initializes nothing.
        self.parallel = init_parallel(
            dist,
            payload={"model_path": str(self.model_dir.resolve()), "dtype": str(self.dtype), "block_size": block_size,
                     "device": self.device.type, "quantization": self.quantization},
            agree_on=("model_path", "dtype", "block_size", "device", "quantization"), device=self.device)
        self.model = self._shared_model(model) if model is not None else load_model(
            self.model_dir, self.dtype, self.config, parallel=self.parallel, device=self.device,
            quantization=self.quantization)
        self.max_model_len = self._max_model_len(settings.max_model_len)
        # "auto": Triton where the KV cache lives on CUDA, torch elsewhere.
        self.attention_backend = backend_class(settings.attention_backend, self.device)
        self.attention_backend.check_block_size(block_size)
        install_backend(self.model, self.attention_backend)
        bind_registered_attributes(self.model)  # the tree is final: its reads skip Module.__getattr__
        if self.device.type == "cpu":
            cpu_kernels.load()  # Build the CPU kernels at model load, not during the first request.
            decoder = getattr(self.model, "model", None)
            if isinstance(decoder, DecoderModel):
                decoder.cpu_decoder_stack = CpuDecoderStack.build(decoder)
        self.sampler = Sampler(sampler_seed, self.device)
        self.uses_graphs = self._uses_graphs()  # Decided once: profiling measures the same graphs.
        self._allocate_kv_caches(settings)
        # Structured output: the tokenizer loads at the first constrained request.
        grammars = Grammars(self.model_dir, self.config.vocab_size, eos_token_ids(self.model_dir, self.config))
        self.batch = InputBatch(block_size, self.num_kv_blocks, self.max_model_len, self.attention_backend,
                                self.device, grammars)
        self.mover = kvc.BlockMover(self.kv_caches, self.cpu_kv_caches)
        self.graphs = self._decode_graphs(self.kv_caches) if self.uses_graphs else None
        self.piecewise = self._piecewise_graphs(self.kv_caches) if self.uses_graphs else None
        if self.graphs is not None:
            self.graphs.capture()
            self.piecewise.capture()
        self._interrupted_step_id = -1  # Set by interrupt() from the service's thread.
        # Launched, not read back yet (oldest first; at most two): see launch.
        self._unfinished: collections.deque[LaunchedStep] = collections.deque()
        self.host_ids = HostIds(self.device, settings.max_num_batched_tokens)
        self._info = self._worker_info(model_name or self.model_dir.name)
        self._log_ready()

    def _shared_model(self, model):
        """`model` (weights another runner loaded), once checked to be what this runner
        would have loaded: one process, this device, dtype and quantization."""
        if self.parallel.world.size > 1:
            raise ValueError("a parallel group's rank loads its own shard; it cannot share weights")
        p = next(model.parameters())
        if (p.device, p.dtype) != (self.device, self.dtype):
            raise ValueError(f"shared weights are {p.dtype} on {p.device}; this runner wants "
                             f"{self.dtype} on {self.device}")
        if getattr(model, "quantization", "none") != self.quantization:
            raise ValueError(f"shared weights have quantization {getattr(model, 'quantization', 'none')}; "
                             f"this runner wants {self.quantization}")
        return model

    def _log_ready(self) -> None:
        # NOTE: with a window on every layer a sequence holds about its window's blocks, however long.
        window = release_window(self.config)
        per_sequence = min(self.max_model_len, window + self.block_size) if window else self.max_model_len
        logger.info("# KV blocks: %d (%d CPU swap blocks), max concurrency for %d-token requests: %.2fx "
                    "(%s, %s, quantization %s, %s)%s", self.num_kv_blocks, self.num_cpu_blocks, self.max_model_len,
                    self.num_kv_blocks * self.block_size / per_sequence, self.device, dtype_name(self.dtype),
                    describe_quantization(self.model, self.quantization),
                    "CUDA graphs" if self.graphs is not None else "eager",
                    f"; every layer attends to the last {window} tokens: a sequence holds ~{per_sequence} tokens "
                    "of KV, older blocks are released" if window else "")

    def _uses_graphs(self) -> bool:
        """CUDA graphs (whole-forward ones for decode steps, piecewise ones for steps with
        prefill rows): on CUDA, unless --enforce-eager, with the Triton attention backend
        and a single pipeline stage (see cuda_graphs.py, piecewise_graphs.py)."""
        if self.device.type != "cuda" or self.settings.enforce_eager:
            return False
        if self.attention_backend.__name__ != "TritonPagedAttention" or self.parallel.pp.size > 1:
            logger.warning("CUDA graphs off: they need the triton attention backend and one pipeline stage "
                           "(backend %s, %d stages)", self.attention_backend.__name__, self.parallel.pp.size)
            return False
        return True

    def _decode_graphs(self, kv_caches: list[torch.Tensor]) -> DecodeGraphs:
        sizes = capture_sizes(min(self.settings.max_num_seqs, self.settings.max_num_batched_tokens))
        return DecodeGraphs(self.model, kv_caches, sizes, cdiv(self.max_model_len, self.block_size),
                            self.block_size, self.device)

    def _piecewise_graphs(self, kv_caches: list[torch.Tensor]) -> PiecewiseGraphs:
        return PiecewiseGraphs(self.model.model, kv_caches, token_ladder(self.settings.max_num_batched_tokens),
                               self.device)

    def _max_model_len(self, cap: int | None) -> int:
        """--max-model-len, at most the model's max_position_embeddings. NOTE: a sliding
        window does not cap it: windowed layers attend to their window (decoder.sliding_windows)."""
        cfg = self.config
        return min(cap or cfg.max_position_embeddings, cfg.max_position_embeddings)

    def _allocate_kv_caches(self, settings: RunnerConfig) -> None:
        """The KV cache on this rank's device (sized by `num_kv_blocks`, or what the memory
        budget leaves after a profiling forward) and the host swap pool (pinned on CUDA, so
        swaps are asynchronous copies)."""
        # NOTE: this rank caches its own layers and its own KV heads only.
        cfg, bs = self.config, self.block_size
        num_layers, kvh, hd = self.model.num_local_layers, local_kv_heads(cfg, self.parallel.tp.size), head_dim_of(cfg)
        block_bytes = kvc.bytes_per_block(bs, kvh, hd, num_layers, self.dtype)
        num_kv_blocks = settings.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = self._blocks_from_profile(
                block_bytes, settings.kv_cache_memory, settings.max_num_batched_tokens, settings.gpu_memory_utilization)
        # Every rank sized its cache from the same budget; all allocate the smallest count.
        self.num_kv_blocks = self.parallel.min_over_world(num_kv_blocks)
        self.kv_caches = kvc.allocate_kv_caches(num_layers, self.num_kv_blocks, bs, kvh, hd, self.dtype,
                                                device=self.device)
        self.num_cpu_blocks = self.parallel.min_over_world(settings.swap_space // block_bytes)
        self.cpu_kv_caches = kvc.allocate_kv_caches(
            num_layers, self.num_cpu_blocks, bs, kvh, hd, self.dtype, zeroed=False,
            pin_memory=self.device.type == "cuda") if self.num_cpu_blocks else []

    def _worker_info(self, model_name: str) -> WorkerInfo:
        cfg = self.config
        return WorkerInfo(
            model=model_name,
            model_path=str(self.model_dir),
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            dtype=dtype_name(self.dtype),
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos_token_ids(self.model_dir, cfg),
            bos_token_id=cfg.bos_token_id if getattr(cfg, "bos_token_id", None) is not None else -1,
            num_cpu_blocks=self.num_cpu_blocks,
            tensor_parallel_size=self.parallel.tp.size,
            device=self.device_label,
            device_memory_bytes=self.device_memory_bytes,
            cuda_graphs=self.graphs is not None,
            quantization=self.quantization,
            dtype_reason=self.dtype_choice.reason,
            sliding_window=release_window(cfg),
        )

    def _blocks_from_profile(self, block_bytes: int, kv_cache_memory_bytes: int | None,
                             max_num_batched_tokens: int, gpu_memory_utilization: float) -> int:
        """KV blocks that fit the memory left once a dummy forward of max_num_batched_tokens
        tokens has shown the peak activation memory (vLLM's profiling run).

        On CUDA: budget = total x gpu_memory_utilization - (weights + activation peak
        + the decode graphs' memory pool + memory outside torch's allocator: the CUDA
        context, NCCL, other processes). The graphs are captured once here against a
        scratch cache to measure their pool, then dropped (the real ones need the real
        cache's addresses)."""
        device = self.device
        with kvc.PeakMemory(device) as peak:
            self._dummy_forward(max_num_batched_tokens)
        if kv_cache_memory_bytes is not None:
            budget = kv_cache_memory_bytes  # Explicit: the KV cache's own size, on any device.
        elif device.type == "cuda":
            # NOTE: read before the graphs' capture: the weights plus the forward's peak.
            forward_peak = torch.cuda.max_memory_allocated(device)
            graph_bytes = self._graph_memory() if self.uses_graphs else 0
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            outside_torch = total - free - torch.cuda.memory_reserved(device)
            budget = int(total * gpu_memory_utilization) - (forward_peak + graph_bytes + outside_torch)
            logger.info("profiling on %s: %.2f GiB total, weights + %d-token forward peak %.2f GiB, "
                        "CUDA graphs %.1f MiB, outside torch %.2f GiB; KV cache budget at %.0f%%: %.2f GiB",
                        device, total / 2**30, max_num_batched_tokens, forward_peak / 2**30, graph_bytes / 2**20,
                        outside_torch / 2**30, gpu_memory_utilization * 100, budget / 2**30)
        else:  # A share of the RAM available now, less what activations will take.
            budget = kvc.default_kv_cache_bytes() - peak.peak_bytes
        logger.info("profiling: %d-token dummy forward peaked at %.1f MiB; KV cache budget %.1f MiB",
                    max_num_batched_tokens, peak.peak_bytes / 2**20, budget / 2**20)
        return kvc.num_blocks_for_budget(budget, block_bytes)

    def _scratch_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return kvc.allocate_kv_caches(self.model.num_local_layers, num_blocks, self.block_size,
                                      local_kv_heads(self.config, self.parallel.tp.size), head_dim_of(self.config),
                                      self.dtype, device=self.device)

    def _graph_memory(self) -> int:
        """Bytes the decode and piecewise graphs' memory pools take, measured by capturing
        them once over a one-sequence scratch cache."""
        caches = self._scratch_caches(cdiv(self.max_model_len, self.block_size))
        graphs, piecewise = self._decode_graphs(caches), self._piecewise_graphs(caches)
        graphs.capture(log=False)
        piecewise.capture(log=False)
        return graphs.memory_bytes + piecewise.memory_bytes

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill step of `num_tokens` tokens (split into max_model_len sequences)
        on a scratch cache just large enough, sampling every sequence."""
        bs = self.block_size
        lens = [min(self.max_model_len, num_tokens - start) for start in range(0, num_tokens, self.max_model_len)]
        num_blocks = sum(cdiv(n, bs) for n in lens)
        caches = self._scratch_caches(num_blocks)
        batch = InputBatch(bs, num_blocks, self.max_model_len, self.attention_backend, self.device)
        plan, next_block = StepPlan(step_id=-1), 0
        for i, n in enumerate(lens):
            blocks = list(range(next_block, next_block + cdiv(n, bs)))
            next_block += len(blocks)
            plan.new_requests.append(NewRequestData(i, [0] * n, n, SamplingParams(temperature=0.0), blocks, 0, n))
        with torch.inference_mode():
            inp = batch.build_inputs(batch.apply_plan(plan))
            # NOTE: every rank profiles in lockstep (the same collectives as a real step).
            logits = forward_step(self.model, self.parallel, inp.input_ids, inp.positions, caches, inp.meta,
                                  inp.sample_indices)
            if logits is not None and self.parallel.is_driver:
                self.sampler(logits, inp.sampling)
            if self.device.type == "cuda" and self.parallel.is_driver:
                # The sampler's own peak at a full decode batch of random rows: [rows, vocab]
                # float32 logits, probabilities and noise. (On the CPU the budget is a share
                # of RAM, far above it.)
                rows = self.settings.max_num_seqs
                fake = torch.randn(rows, self.config.vocab_size, device=self.device)
                random_rows = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
                self.sampler(fake, SamplingRows.from_params(random_rows, [0] * rows))

    @property
    def info(self) -> WorkerInfo:
        return self._info

    def reset_requests(self) -> None:
        """Forget every request (a new scheduler stream resends them in full), once the
        steps still in flight are done with the device."""
        for launched in self._unfinished:
            launched.wait()
        self._unfinished.clear()
        self.batch.clear()

    def interrupt(self, step_id: int) -> None:
        """Ask the multi-step plan `step_id` to stop after its current step. Any thread may
        call it; a plan that is done (or not yet started) and has another id ignores it."""
        self._interrupted_step_id = step_id

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to the end: finish(launch(plan)). Raises ValueError on an
        inconsistent plan (states unchanged)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan, move its blocks, then run its forward and sampling without
        reading the sampled ids back: each sampled row gets a placeholder, which the next
        plan's inputs take from the device (launched_step.py). A multi-step plan runs its
        decode steps back to back (each step's ids read back, the next one's inputs) until
        done or interrupted; its last step stays in flight.

        At most one step stays in flight while another is launched: an older one is read
        back first, and so is the one in flight when the plan cannot go ahead of it
        (must_finish_first). Raises ValueError on an inconsistent plan (states unchanged)."""
        self._finish_before(plan)
        prev = self._unfinished[-1].pending if self._unfinished else None
        with torch.inference_mode(), self._on_device():  # a multi-step plan's steps each replay their graph
            rows = self.batch.apply_plan(plan)
            self._move_blocks(plan)
            launched = LaunchedStep(plan, rows)
            steps_run = 0
            while rows and steps_run < plan.num_steps and (steps_run == 0 or self._run_on(plan.step_id)):
                if launched.pending is not None:  # A multi-step run: its next step reads these ids.
                    launched.sampled += self._read_back(launched.pending)
                launched.pending, prompt = self._launch_step(rows, prev.ids if prev is not None else None)
                if prompt is not None:
                    launched.prompt_logprobs.append(prompt)
                steps_run += 1
            launched.num_steps = max(steps_run, 1)
        self._unfinished.append(launched)
        return launched

    def finish(self, launched: LaunchedStep) -> StepResult:
        """The launched plan's StepResult: waits for its sampled ids on the host, writes
        them over its placeholders, advances grammars and accepts drafts. A state that a
        later plan dropped meanwhile still reports its token. Called again (a later
        launch may have finished it first), returns the same result or raises the same
        error."""
        if launched.error is not None:
            raise launched.error
        if launched.result is None:
            try:
                if launched.pending is not None:
                    launched.sampled += self._read_back(launched.pending)
                    launched.pending = None
                launched.result = StepResult(step_id=launched.plan.step_id, sampled=launched.sampled,
                                             num_steps=launched.num_steps,
                                             prompt_logprobs=[chunk for pending in launched.prompt_logprobs
                                                              for chunk in pending.read()])
            except BaseException as exc:
                launched.error = exc
                raise
            finally:
                if launched in self._unfinished:
                    self._unfinished.remove(launched)
        return launched.result

    def _finish_before(self, plan: StepPlan) -> None:
        """Reads back what must be before `plan` is launched: all but the last step in
        flight, and that one too where `plan` cannot go ahead of it."""
        while len(self._unfinished) > 1:
            self.finish(self._unfinished[0])
        if self._unfinished and must_finish_first(self._unfinished[-1], plan, self.batch.states):
            self.finish(self._unfinished[-1])

    def _on_device(self):
        # NOTE: Triton launches on the current device's stream: make this rank's current.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _run_on(self, step_id: int) -> bool:
        """Whether a multi-step run goes on to its next step. In a TP x PP group every rank
        must run the same steps, so the driver decides for all (interrupts reach the ranks
        at different moments)."""
        go_on = self._interrupted_step_id != step_id
        if self.parallel.world.size == 1:
            return go_on
        return bool(self.parallel.broadcast_from_driver([int(go_on) if self.parallel.is_driver else 0])[0])

    def _move_blocks(self, plan: StepPlan) -> None:
        """The plan's swaps and copy-on-write copies, before the forward: out, in, copies."""
        kvc.check_moves(plan.swap_out, self.num_kv_blocks, self.num_cpu_blocks, "swap-out")
        kvc.check_moves(plan.swap_in, self.num_cpu_blocks, self.num_kv_blocks, "swap-in")
        kvc.check_moves(plan.copies, self.num_kv_blocks, self.num_kv_blocks, "copy")
        self.mover.run(plan.swap_out, plan.swap_in, plan.copies)

    def _forward(self, inp) -> torch.Tensor | None:
        """Logits [S + P, vocab] at the step's logit_indices (sampled rows, then prompt
        logprobs positions; last stage; None elsewhere): a decode step through its CUDA
        graph, a step with prefill rows through the piecewise graphs (within their ladder),
        else eagerly."""
        hidden = self._graph_forward(inp)  # [T, hidden] or None
        if hidden is None:
            return forward_step(self.model, self.parallel, inp.input_ids, inp.positions, self.kv_caches,
                                inp.meta, inp.logit_indices)
        return self.model.compute_logits(hidden[inp.logit_indices]) if inp.logit_indices.numel() else None

    def _graph_forward(self, inp) -> torch.Tensor | None:
        """The step's hidden states [T, hidden] from the captured graphs (None: run eagerly)."""
        T = inp.input_ids.shape[0]
        size = self.graphs.size_for(inp.meta, T) if self.graphs is not None else None
        if size is not None:
            return self.graphs.replay(size, inp.input_ids, inp.positions, inp.meta)
        size = self.piecewise.size_for(T) if self.piecewise is not None else None
        return self.piecewise.run(size, inp.input_ids, inp.positions, inp.meta) if size is not None else None

    def _launch_step(self, rows, prev_sampled: torch.Tensor | None
                     ) -> tuple[DeviceStep | None, PendingPromptLogprobs | None]:
        """One forward and its sampling, the ids left on the device (and on their way to
        the host), None when the step samples nothing (prefill chunks only); and the
        prompt logprobs of the rows that ask, on their way to the host too (the driver's;
        None elsewhere or when no row asks).
        prev_sampled: [S'] the ids of the step in flight, where this step's inputs'
        placeholders are."""
        inp = self.batch.build_inputs(rows, prev_sampled)
        logits = self._forward(inp)  # [S + P, vocab] on the last PP stage; None elsewhere
        for st, n in rows:
            st.num_computed_tokens += n - len(st.draft_token_ids)  # Drafts count once accepted.
        S = len(inp.sample_states)
        on_driver = logits is not None and self.parallel.is_driver
        prompt = self._prompt_logprobs(inp.prompt_rows, logits[S:]) if on_driver else None
        if not S:
            return None, prompt
        return self._sample(inp, logits[:S] if logits is not None else None), prompt

    def _prompt_logprobs(self, rows: list[PromptRows], logits: torch.Tensor) -> PendingPromptLogprobs | None:
        """logits: [P, vocab], the rows' prompt positions in order."""
        if not rows:
            return None
        targets = torch.tensor([t for r in rows for t in r.targets], dtype=torch.long)
        tensors = prompt_logprob_tensors(logits, targets, max(r.state.sampling.prompt_logprobs for r in rows))
        copied, host = self.host_ids.copy_tensors(tensors)
        return PendingPromptLogprobs(tuple((r.state.seq_id, r.start, r.count, r.state.sampling.prompt_logprobs)
                                           for r in rows), host, copied)

    def _sample(self, inp, logits: torch.Tensor | None) -> DeviceStep:
        """The step's sampling (logits: [S, vocab] on the driver, None elsewhere)."""
        states = inp.sample_states
        logprobs = PendingLogprobs(len(states))
        if self.parallel.is_driver:  # sampling happens on the last stage's TP rank 0 only
            out = self.sampler(logits, inp.sampling)
            tokens, logprobs = out.token_ids, out.pending_logprobs
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=self.device)
        # Every rank keeps the same ids: a broadcast on the device (a collective: in the
        # launch, on every rank alike); the read back is finish's, logprobs' too.
        tokens = self.parallel.broadcast_tensor_from_driver(tokens)  # [S]
        host_ids, copied, host_logprobs = self.host_ids.copy(tokens, logprobs.tensors)
        logprobs = logprobs.with_tensors(host_logprobs)
        # A row verifying drafts appends its kept tokens at read back (the next plan waits for it).
        placeholders = [None if st.draft_token_ids else self._placeholder(st, k) for k, st in enumerate(states)]
        return DeviceStep(states, inp.sample_offsets, logprobs, tokens, host_ids, copied, placeholders)

    @staticmethod
    def _placeholder(st: RequestState, index: int) -> Placeholder:
        st.token_ids.append(PLACEHOLDER)
        st.placeholder = Placeholder(st, len(st.token_ids) - 1, index)
        return st.placeholder

    def _read_back(self, step: DeviceStep) -> list[SampledToken]:
        """The step's ids on the host (its one wait for the device), written over its
        placeholders; grammars advanced; drafts accepted or rejected."""
        if step.copied is not None:
            step.copied.synchronize()
        token_ids = step.host_ids.tolist()
        logprobs = step.logprobs.read()
        out = []
        rejected: set[int] = set()  # Rows verifying drafts whose kept tokens are complete.
        for st, j, tok, lp, ph in zip(step.states, step.offsets, token_ids, logprobs, step.placeholders):
            if st.seq_id in rejected:
                continue
            if ph is not None:
                st.token_ids[ph.position] = tok
                if st.placeholder is ph:
                    st.placeholder = None
            else:
                # Keep the sample at position j; it accepts draft j when they agree, and
                # then position j + 1's sample is next (each sampled from the target
                # distribution, so the kept tokens are distributed as plain decoding's).
                if j < len(st.draft_token_ids) and tok == st.draft_token_ids[j]:
                    st.num_computed_tokens += 1
                else:
                    rejected.add(st.seq_id)
                st.token_ids.append(tok)
            if st.grammar is not None:
                st.grammar.advance(tok)
            out.append(SampledToken(st.seq_id, tok, lp))
        for st, ph in zip(step.states, step.placeholders):
            if ph is None:
                st.draft_token_ids = []
        return out
