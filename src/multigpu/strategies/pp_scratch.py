"""Pipeline parallelism from scratch: the layers cut into stages, micro-batches flowing through.

Stage s of p holds a contiguous run of blocks (`pp_split.split_gpt`); the first also the
embeddings, the last the head and the loss. A micro-batch's forward goes stage 0 -> p-1,
each stage sending its output activation to the next; its backward comes back p-1 -> 0,
each stage sending the gradient of its input to the previous. Only neighbours talk, and only
one activation-sized tensor per micro-batch and direction: the least traffic of any strategy.

The price is idle time. Which stage runs what, when, is the schedule; three are here:

- naive model parallelism: one micro-batch at a time, all the way forward and back before
  the next starts. Only one stage works at any moment: each is idle (p-1)/p of the step.
- GPipe, all-forward-all-backward (Huang et al. 2019, https://arxiv.org/abs/1811.06965):
  all m forwards, then all m backwards. While stage s works on micro-batch i, stage s+1 works
  on i-1: the stages overlap, and only the fill and drain at either end are idle, the
  "bubble", (p-1)/(m+p-1) of the step. But every stage holds the activations of all m
  micro-batches at once, waiting for their backwards.
- 1F1B (PipeDream-Flush: Narayanan et al. 2019, https://arxiv.org/abs/1806.03377, and
  Megatron-LM, Narayanan et al. 2021, https://arxiv.org/abs/2104.04473, section 2.2):
  stage s runs only p-s-1 forwards ahead ("warm-up"), then alternates one forward, one
  backward, and finally drains the remaining backwards. Same bubble as GPipe, but a stage
  never holds more than p-s micro-batches' activations, whatever m.

A schedule here is a list of actions, ("F", i) or ("B", i), for one stage; `Pipeline.run`
carries them out and receives/sends what each needs (picotron's PP, huggingface/picotron,
is the model for this file). Every action and every wait on a neighbour goes into an event
log with its start and end (`ActionClock`: on a GPU the GPU's own times), so the timelines
and the bubble the book shows are measured, never drawn from the formula.

Gradients equal one device's bit for bit: the last stage divides each micro-batch's loss by
m, and every stage runs the backwards in micro-batch order, so each parameter's gradient is
summed in the order one device running the same micro-batches sums it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from multigpu.strategies import Parallelized, build_optimizer
from multigpu.strategies.pp_split import (
    deep_enough,
    deeper_preset,
    loss_to_all,
    split_gpt,
    sync_tied_embedding,
    tied_embedding_group,
)
from multigpu.strategies.state import pipeline_state_dict

# -- the event log's clock ------------------------------------------------------------------


class ActionClock:
    """When each action of a step ran, in seconds from the step's start, as the device saw it.

    On a GPU, kernels and NCCL's waits are asynchronous for the host: a box timed with
    time.perf_counter around them is the time it took to enqueue them, and its gaps are where
    the host happened to block. So on CUDA a mark (`now`) is a `torch.cuda.Event` recorded on
    the current stream, and a box runs from when the GPU reached its start to when it finished
    the action; the events are read when the log is (`events`), after the step has ended, so
    timing adds no synchronization inside the step. Every time is measured from one event
    recorded as the step starts. On a CPU the host's clock is the device's: time.perf_counter.

    `clock` says which it was ("cuda-events" or "host"), for the report: a timeline must not
    claim the GPU's time for the host's. The library's pipeline (`pp.log_actions`) logs its
    actions with the same class."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = "cuda-events" if self.cuda else "host"
        self.start_unix: float | None = None  # the step's start on the wall clock, to line up one machine's ranks
        self._origin = None
        self._marks: list[tuple[dict, object, object]] = []  # (fields, start mark, end mark), in order
        self._events: list[dict] | None = []
        self.in_flight = self.peak_in_flight = 0  # micro-batches whose forward ran and backward not yet

    def start_step(self) -> None:
        """A new step: the last one's log is dropped, and time counts from here."""
        self._marks, self._events = [], None
        self.in_flight = self.peak_in_flight = 0
        self.start_unix = time.time()
        self._origin = self.now()

    def now(self):
        """This moment, as a mark for `log`: an event on the current stream, or the host's time."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def log(self, start, **fields) -> None:
        """An action (`fields`: its stage, action, micro-batch) from the mark `start` to now."""
        self._marks.append((fields, start, self.now()))

    @contextmanager
    def box(self, stage: int, action: str, micro: int):
        """`with clock.box(stage, "F", i):` logs what runs inside as one action; a forward adds a
        micro-batch in flight (its activations kept), a backward takes it away. `peak_in_flight`:
        the most at once in this step."""
        start = self.now()
        yield
        self.log(start, stage=stage, action=action, micro=micro)
        self.in_flight += {"F": 1, "B": -1}.get(action, 0)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    @property
    def events(self) -> list[dict]:
        """The step's log, {**fields, "start_s", "end_s"} per action, in the order logged."""
        if self._events is None:
            if self.cuda:  # every mark must have happened before it is read: long ago, after the step
                for mark in (self._origin, *(m for _, start, end in self._marks for m in (start, end))):
                    mark.synchronize()
                seconds = lambda mark: self._origin.elapsed_time(mark) / 1e3  # noqa: E731 - ms -> s
            else:
                seconds = lambda mark: mark - self._origin  # noqa: E731
            self._events = [{**fields, "start_s": seconds(start), "end_s": seconds(end)}
                            for fields, start, end in self._marks]
        return self._events


# -- schedules: which action a stage runs next -------------------------------------------------


def naive(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """One micro-batch at a time: F0 B0 F1 B1 ... on every stage (1F1B with no warm-up)."""
    return [action for i in range(m) for action in (("F", i), ("B", i))]


def gpipe(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards, in micro-batch order (as torch's ScheduleGPipe)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards. Stage s
    runs p-s-1 forwards ahead: just enough that the last stage's first backward, the first
    that can run, comes back to it as its next forward would otherwise wait."""
    warmup = min(p - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: F of the newest, B of the oldest in flight
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]  # cool-down


SCHEDULES = {"pp-naive": naive, "pp-gpipe-scratch": gpipe, "pp-1f1b-scratch": one_f_one_b}


# -- point to point: this stage's two neighbours -------------------------------------------------


class Neighbours:
    """Sends and receives between this stage and the previous (activations in, gradients out)
    and the next (activations out, gradients in). Every message is one (micro_batch, seq,
    d_model) tensor, so receive buffers are made from that fixed shape (picotron does the
    same; a varying shape would need a handshake first).

    All go through `batch_isend_irecv`: the operations of one call are posted together and
    then awaited. That is what the fused pairs need: in 1F1B's steady state stage s sends an
    activation to s+1 while s+1 sends a gradient to s. Were each to send first and receive
    afterwards with a blocking (rendezvous) send, as NCCL's can be, both would wait for the
    other to receive: deadlock. Posted together, both complete."""

    def __init__(self, group, stage: int, num_stages: int, shape, dtype, device, clock: ActionClock):
        self.group, self.shape, self.dtype, self.device, self.clock = group, tuple(shape), dtype, device, clock
        self.stage = stage
        self.prev = stage - 1 if stage > 0 else None  # ranks within the pipeline's group
        self.next = stage + 1 if stage < num_stages - 1 else None

    def _exchange(self, op: str, micro: int, to_next=None, to_prev=None, from_prev=False, from_next=False):
        start = self.clock.now()
        ops, received = [], []
        # gloo sends only contiguous memory; a gradient from autograd may be a strided view
        for tensor, peer in ((to_next, self.next), (to_prev, self.prev)):
            if tensor is not None:
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), group=self.group, group_peer=peer))
        for wanted, peer in ((from_prev, self.prev), (from_next, self.next)):
            if wanted:
                received.append(torch.empty(self.shape, dtype=self.dtype, device=self.device))
                ops.append(dist.P2POp(dist.irecv, received[-1], group=self.group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # on CUDA: the current stream waits for NCCL's, and the end mark comes after
        self.clock.log(start, stage=self.stage, action=op, micro=micro)
        return received[0] if received else None

    def send_forward(self, h, micro):
        self._exchange("send_forward", micro, to_next=h)

    def recv_forward(self, micro):
        return self._exchange("recv_forward", micro, from_prev=True)

    def send_backward(self, grad, micro):
        self._exchange("send_backward", micro, to_prev=grad)

    def recv_backward(self, micro):
        return self._exchange("recv_backward", micro, from_next=True)

    def send_forward_recv_backward(self, h, micro):
        """Activation of `micro` to the next stage; a gradient from it (for the next backward)."""
        return self._exchange("send_forward_recv_backward", micro, to_next=h, from_next=True)

    def send_backward_recv_forward(self, grad, micro):
        """Input gradient of `micro` to the previous stage; an activation from it (next forward)."""
        return self._exchange("send_backward_recv_forward", micro, to_prev=grad, from_prev=True)


# -- one stage running a schedule ---------------------------------------------------------------


class Pipeline:
    """This rank's stage: the cut model, its place in the pipeline, its schedule, its log.

    The event log of a step (`events`), one dict per action, in the order they ran:
        {"stage": s, "action": a, "micro": i, "start_s": t0, "end_s": t1}
    with times in seconds from the start of this rank's step, on the clock `clock` names
    (`ActionClock`: the GPU's, or the host's), and `step_start_unix` that start on the wall
    clock, to line up the stages of one machine. `action` is "F" or "B"
    (the compute of micro-batch i, nothing else inside), or the communication that ran after
    or before it: "recv_forward", "send_forward", "recv_backward", "send_backward",
    "send_forward_recv_backward", "send_backward_recv_forward" (i: the micro-batch whose
    activation or gradient is sent, or else received). A wait on a neighbour is the time in
    such a box; idle time is what no box covers."""

    def __init__(self, model, group, stage: int, num_stages: int, schedule):
        self.model, self.group, self.stage, self.p, self.schedule = model, group, stage, num_stages, schedule
        self.first, self.last = stage == 0, stage == num_stages - 1
        # activations cross stage boundaries in the model's dtype (fp32): under bf16 autocast
        # the residual stream is fp32 anyway (fp32 embedding + bf16 branch promotes to fp32),
        # and the cast below makes sure a receiver's buffer always has the sender's dtype
        self.dtype = next(model.parameters()).dtype
        self._clock: ActionClock | None = None  # the last step's log

    @property
    def events(self) -> list[dict]:
        """The last step's event log (read after the step: on a GPU this waits for its end)."""
        return self._clock.events if self._clock else []

    @property
    def clock(self) -> str | None:
        return self._clock.clock if self._clock else None

    @property
    def peak_in_flight(self) -> int:
        """The most micro-batches whose forward ran and backward not yet, in the last step."""
        return self._clock.peak_in_flight if self._clock else 0

    @property
    def step_start_unix(self) -> float | None:
        return self._clock.start_unix if self._clock else None

    def run(self, micro_batches: list[dict], autocast_dtype=None, before_forward=lambda i: None):
        """Every action of this stage's schedule for one step's micro-batches; gradients are
        left in .grad. Returns the sum of the micro-batches' loss/m: on the last stage a
        float64 tensor on the device, read by the caller once per step (a .item() per
        micro-batch would stop the host every time); elsewhere 0.0."""
        m = len(micro_batches)
        ids = micro_batches[0]["input_ids"]  # (micro_batch, seq), the same on every stage
        device = ids.device
        shape = (*ids.shape, self.model.cfg.d_model)  # (micro_batch, seq, d_model)
        if self._clock is None:
            self._clock = ActionClock(device)
        clock = self._clock
        clock.start_step()
        link = Neighbours(self.group, self.stage, self.p, shape, self.dtype, device, clock)
        autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                    else nullcontext())
        inputs, outputs = {}, {}  # micro -> this stage's input / output, kept until its backward
        arrived = {}  # (action, micro) -> the activation or gradient it needs, already received
        # in float64, one addition at a time, as the shared loop sums (strategies.micro_batch_step)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device) if self.last else 0.0
        actions = self.schedule(self.stage, self.p, m)
        for k, (action, i) in enumerate(actions):
            if action == "F":
                if not self.first and ("F", i) not in arrived:
                    arrived["F", i] = link.recv_forward(i)
                before_forward(i)
                with clock.box(self.stage, "F", i):
                    if self.first:
                        kwargs = {"input_ids": micro_batches[i]["input_ids"]}
                    else:  # a leaf that wants a gradient: its .grad is what we send back
                        inputs[i] = arrived.pop(("F", i)).requires_grad_()
                        kwargs = {"hidden": inputs[i]}
                    with autocast:
                        if self.last:
                            out = self.model(**kwargs, labels=micro_batches[i]["labels"]) / m
                            loss_sum = loss_sum + out.detach().double()
                        else:
                            out = self.model(**kwargs).to(self.dtype)  # (micro_batch, seq, d_model)
                    outputs[i] = out
            else:
                if not self.last and ("B", i) not in arrived:
                    arrived["B", i] = link.recv_backward(i)
                with clock.box(self.stage, "B", i):  # this micro-batch's activations are freed after it
                    out = outputs.pop(i)
                    # backward from this stage's output, seeded by the gradient the next stage sent
                    # (picotron's backward(); the last stage's output is the loss: no seed)
                    torch.autograd.backward(out, grad_tensors=None if self.last else arrived.pop(("B", i)))
                    input_grad = None if self.first else inputs.pop(i).grad
            # Send what the action made, together with what the next action must receive when
            # that comes from the same neighbour: the fused pair of the class docstring
            after = actions[k + 1] if k + 1 < len(actions) else None
            if action == "F" and not self.last:
                if after is not None and after[0] == "B":
                    arrived[after] = link.send_forward_recv_backward(out, i)
                else:
                    link.send_forward(out, i)
            elif action == "B" and not self.first:
                if after is not None and after[0] == "F":
                    arrived[after] = link.send_backward_recv_forward(input_grad, i)
                else:
                    link.send_backward(input_grad, i)
        return loss_sum


# -- the strategy -----------------------------------------------------------------------------


def config_problems(cfg) -> list[str]:
    """What keeps this run from being cut into pipeline stages (empty: nothing); RunConfig
    calls it before any process starts."""
    from multigpu.models import GPT_SIZES, family, read_config_file

    kind = family(cfg.model)
    if kind != "gpt":
        return [f"the pipeline from scratch cuts the package's GPT into stages, and {cfg.model!r} is a "
                f"{kind} model; use a gpt-* preset (e.g. gpt-mini, 4 blocks) or a gpt2 config.json"]
    stages = cfg.degrees["pp"]
    n_layer = GPT_SIZES[cfg.model].n_layer if cfg.model in GPT_SIZES else read_config_file(cfg.model)["n_layer"]
    if stages > n_layer:
        return [f"{stages} stages cannot split {cfg.model}'s {n_layer} blocks (a stage needs at least one); "
                f"use at most {n_layer} processes, or a deeper model{deeper_preset(stages)}"]
    return []


def defaults(cfg) -> dict:
    """What this run needs that the package's defaults do not give (config.with_strategy_defaults
    applies it where the reader chose nothing): a GPT with a block for every stage."""
    model = deep_enough(cfg.model, cfg.degrees["pp"])
    return {"model": model} if model else {}


def prepare(model, cfg, rt) -> Parallelized:
    grid = rt.grid  # pipeline stages only: RunConfig.validate refuses a dp or tp (the strategy table's `combines`)
    if cfg.strategy not in SCHEDULES:
        raise ValueError(f"no pipeline schedule is called {cfg.strategy!r}; choose one of: {', '.join(SCHEDULES)}")
    stage, p = grid.coord("pp"), grid.size("pp")
    tied_group = tied_embedding_group(grid)  # every rank, before anything else: it creates groups
    split_gpt(model, stage, p)
    optimizer = build_optimizer(model.parameters(), cfg)  # this stage's parameters
    pipe = Pipeline(model, grid.group("pp"), stage, p, SCHEDULES[cfg.strategy])

    def train_step(par, micro_batches, autocast_dtype=None, before_forward=lambda i: None) -> float:
        par.zero_grad()
        loss = pipe.run(micro_batches, autocast_dtype, before_forward)
        sync_tied_embedding(model, tied_group, stage, p)  # the tied weight: head's + embedding's share
        par.step()
        # broadcast on the device the batches are on: this rank's (NCCL has no CPU tensors)
        return loss_to_all(loss, grid, micro_batches[0]["input_ids"].device)

    def report() -> dict:
        return {"schedule": cfg.strategy, "stage": stage, "stages": p, "events": pipe.events, "clock": pipe.clock,
                "peak_in_flight": pipe.peak_in_flight, "step_start_unix": pipe.step_start_unix}

    return Parallelized(module=model, optimizer=optimizer, model=model, train_step=train_step, report=report,
                        gather_state_dict=lambda: pipeline_state_dict([model], grid))
