"""Count what ``torch.compile`` compiles while a run trains, and say why it recompiled.

A compiled model that keeps recompiling is slower than an eager one, and nothing tells the
user: Dynamo silently falls back to eager for a function once it hits its recompile limit.
The watch listens to Dynamo's compile callbacks (its registration API, nothing patched): every
traced frame (``DYNAMO``) and every backward graph compiled at the first backward
(``LAZY_BACKWARD``) is counted against the optimizer step it happened in. Compiling during the
first step is the expected cold start; any Dynamo compile of a training step after it is a
recompile that costs time, and gets a warning with Dynamo's own reason (from its compilation
metrics). Evaluation runs without gradients and compiles its own graphs; those are counted
apart and never warned about.

It also counts the CUDA graphs Inductor records (``CUDAGRAPH_RECORDING``). A layer's graph is
recorded once, in the first steps; recorded again on every step, its inputs moved between
steps (a parameter whose storage is allocated anew each step, as FSDP2's gathered ones can be)
and each recording synchronizes the device and keeps another copy of its memory: slower than no
graphs. Recordings in two consecutive steps after :data:`GRAPH_WARMUP_STEPS` get one warning
(an evaluation pass records its own graphs once, in one step; a recording runs inside the
compiled function's autograd forward, where gradients are off, so it cannot tell training from
evaluation by the grad mode).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Warnings printed for recompiles after the first step; later ones are only counted.
MAX_WARNINGS = 3
#: Steps in which Inductor's CUDA graph trees warm up and record each graph the first time.
GRAPH_WARMUP_STEPS = 3


@dataclass
class CompileEvent:
    compile_id: str
    kind: str  # "forward" (Dynamo traced a frame), "backward" (lazy backward) or "eval"
    step: int  # the optimizer step in progress (the last finished one + 1)
    late: bool  # compiled after this process finished its first optimizer step

    @property
    def frame(self) -> str:
        """The code object's id in the compile id (``frame/N``: the N-th compile of that frame)."""
        return self.compile_id.rpartition("/")[0]

    @property
    def compiled_before(self) -> bool:
        """Dynamo had compiled this frame before (``frame/N`` with N > 0), in this run or an
        earlier one in the same process (its cache outlives a run)."""
        _, _, count = self.compile_id.rpartition("/")
        return count.isdigit() and int(count) > 0


@dataclass
class CompileWatch:
    """Registered with Dynamo between :meth:`start` and :meth:`stop`; feed it every step."""

    warn: Callable[[str], None]
    events: list[CompileEvent] = field(default_factory=list)
    first_step_s: float | None = None
    warned: int = 0
    warned_graphs: bool = False
    #: CUDA graphs recorded in this process's n-th step (1: its first, whatever step a resumed run starts at)
    recordings: dict[int, int] = field(default_factory=dict)
    _step: int = 0  # the last optimizer step finished (a resumed run starts past 0)
    _steps_seen: int = 0
    _callback: Any = None
    available: bool = True

    def start(self) -> "CompileWatch":
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without the callback API: run on, uncounted
            self.available = False
            return self
        self._callback = callback_handler.register_end_callback(self._on_compile_end)
        return self

    def stop(self) -> None:
        if self._callback is not None:
            from torch._dynamo.callback import callback_handler

            callback_handler.remove_end_callback(self._callback)
            self._callback = None

    def _on_compile_end(self, args: Any) -> None:
        import torch

        trigger = getattr(args.callback_trigger, "name", str(args.callback_trigger))
        if trigger == "DYNAMO":
            kind = "forward" if torch.is_grad_enabled() else "eval"
        elif trigger == "LAZY_BACKWARD":
            kind = "backward"
        elif trigger == "CUDAGRAPH_RECORDING":
            nth = self._steps_seen + 1
            self.recordings[nth] = self.recordings.get(nth, 0) + 1
            return
        else:  # autotuning: runtime work, not a compilation of new code
            return
        self.events.append(CompileEvent(str(args.compile_id), kind, self._step + 1, self._steps_seen > 0))

    def on_step(self, step: int, step_time_s: float) -> None:
        """After optimizer step ``step``: record the cold start, warn about late recompiles."""
        if self.first_step_s is None:
            self.first_step_s = step_time_s
        late = [e for e in self.events if e.step == step and e.kind == "forward" and e.late]
        self._step = step
        self._steps_seen += 1
        self._check_graph_recordings(step, self._steps_seen)
        if late and self.warned < MAX_WARNINGS:
            self.warned += 1
            reasons = recompile_reasons([e.compile_id for e in late])
            because = "; ".join(f"{cid}: {r}" for cid, r in reasons.items()) or "no reason recorded"
            self.warn(
                f"step {step}: torch.compile compiled again after the first step ({len(late)} graph(s); {because}). "
                "A change of input shape recompiles once into a dynamic-shape graph (micro-batches of varying "
                "length; packing gives fixed shapes); a recompile on every step means a guard keeps failing and "
                "the run is slower than eager (TORCH_LOGS=recompiles shows each one)"
                + (". Further recompiles are only counted (optimizations.json)" if self.warned == MAX_WARNINGS else "")
            )

    def _check_graph_recordings(self, step: int, nth: int) -> None:
        """Warn once where CUDA graphs were recorded in this step (this process's ``nth``) and the
        one before, both past the warm-up: the graphs are being recorded again every step."""
        if self.warned_graphs or nth <= GRAPH_WARMUP_STEPS + 1:
            return
        now, before = self.recordings.get(nth, 0), self.recordings.get(nth - 1, 0)
        if now and before:
            self.warned_graphs = True
            self.warn(
                f"steps {step - 1}-{step}: CUDA graphs were recorded again ({before} and {now} graph(s)) after the "
                f"first {GRAPH_WARMUP_STEPS} steps: their inputs move between steps (e.g. parameters FSDP2 gathers "
                "into new memory each step) and every recording waits for the device and keeps more memory; "
                "performance.cuda_graphs: false is likely faster here"
            )

    def summary(self) -> dict[str, Any]:
        """Counts for optimizations.json and the console."""
        train = [e for e in self.events if e.kind == "forward"]
        return {
            "first_step_s": round(self.first_step_s, 3) if self.first_step_s is not None else None,
            "forward_graphs": len(train),
            "backward_graphs": sum(e.kind == "backward" for e in self.events),
            "eval_graphs": sum(e.kind == "eval" for e in self.events),
            "recompiles": self._recompiles(train),
            "compiles_after_first_step": sum(e.late for e in train),
            "graph_recordings": sum(self.recordings.values()),
            "graph_recordings_after_warmup": sum(n for nth, n in self.recordings.items() if nth > GRAPH_WARMUP_STEPS),
            "counted": self.available,
        }

    def _recompiles(self, train: list[CompileEvent]) -> int:
        """Training graphs that compiled a frame this run had already compiled. A frame another
        run of the same process compiled first (a bf16 run, then a float8 one, whose layers fail
        the old guards) compiles here for the first time: not a recompile of this run."""
        seen: set[str] = set()
        count = 0
        for event in self.events:
            if event.kind == "forward" and event.compiled_before and event.frame in seen:
                count += 1
            seen.add(event.frame)
        return count


def recompile_reasons(compile_ids: list[str]) -> dict[str, str]:
    """Dynamo's recorded reason for each recompilation (best effort: its metrics keep the last 64)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return {}
    wanted = set(compile_ids)
    found = {}
    for metrics in get_compilation_metrics():
        cid = str(getattr(metrics, "compile_id", ""))
        reason = getattr(metrics, "recompile_reason", None)
        if cid in wanted and reason:
            found[cid] = reason.strip().splitlines()[0][:300]
    return found
