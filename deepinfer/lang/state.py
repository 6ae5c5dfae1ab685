"""ProgramState: the `s` a program appends to, and its fork groups.

A state executes the expressions appended to it in order, asynchronously: appending a `gen` or
`select` submits engine requests and returns at once; expressions appended after it queue up
and run when its result arrives. Reading anything (`s["x"]`, `s.text()`, `fork`, `join`) waits
for the state's queue to drain, suspending the program's greenlet so the runtime can batch the
requests of every program (and of every fork) into the same engine steps.

Token-level state: the prompt is kept as token ids. Appended text collects in a pending buffer
that is tokenised as one string right before it is needed (next request, fork, end), so text
appended piecewise between two generations tokenises exactly like the rendered whole. Generated
tokens are appended exactly as the engine produced them (they are what the engine's prefix cache
holds), minus a finishing stop token (EOS / stop_token_ids, whose text the role suffix adds back)
and minus trailing tokens whose text the engine cut off (a stop string); any cut-off remainder of
the output text goes back into the pending buffer. Text after a generation starts a new
tokenisation at that boundary.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Protocol

import greenlet

from deepinfer.errors import InvalidRequestError, ProgramError
from deepinfer.lang.ir import Expr, Gen, RoleBegin, RoleEnd, Select, Seq, Text, as_expr, flatten
from deepinfer.lang.ops import Event, GenDone, GenNDone, GenOp, MultiGenOp, Op, SelectDone, SelectOp, Streamed
from deepinfer.lang.values import decode_value


class Scheduler(Protocol):
    """What a state asks of the runtime that runs it (lang/runtime.py's Runtime); the state holds
    it through its program and never imports the runtime (the runtime imports this module)."""

    def enqueue(self, op: Op) -> None: ...
    def wait(self, prog: Any, states: list["ProgramState"]) -> None: ...
    def state_idle(self, state: "ProgramState") -> None: ...
    def in_loop_thread(self) -> bool: ...


class Program(Protocol):
    """The program invocation a state belongs to (runtime.Program): its backend, runtime (a
    Scheduler; None when only rendering), defaults, stream flag, completion event and lock."""

    backend: Any
    runtime: Scheduler | None
    defaults: dict[str, Any]
    stream: bool


class _RoleBlock:
    """`with s.user():` opens the turn on entry and closes it on exit."""

    def __init__(self, state: "ProgramState", role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> "ProgramState":
        self.state._push(RoleBegin(self.role))
        return self.state

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.state._push(RoleEnd(self.role))


class _VarScope:
    def __init__(self, state: "ProgramState", name: str) -> None:
        self.state, self.name, self.start = state, name, 0

    def __enter__(self) -> "ProgramState":
        self.start = len(self.state.text())
        return self.state

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.state[self.name] = self.state.text()[self.start:]


class ProgramState:
    """The state of one running (or finished) program; see the module docstring."""

    def __init__(self, prog: "Program", parent: "ProgramState | None" = None) -> None:
        self._prog = prog
        self._be = prog.backend
        self._queue: deque[Expr] = deque()
        self._op: Any = None
        self._error: BaseException | None = None
        self._chunks: list[tuple[str | None, str | None]] | None = [] if prog.stream else None
        self._assigned: list[str] = []  # variables set since the fork (what join gathers)
        if parent is None:
            self._ids: list[int] = []
            self._pending: list[str] = []
            self._text: list[str] = []
            self._vars: dict[str, Any] = {}
            self._meta: dict[str, Any] = {}
            self._messages: list[dict[str, str]] = []
            self._role: str | None = None
            self._role_buf: list[str] = []
            self._any_role = False
            self._fork_text_len = 0
        else:
            parent._text = ["".join(parent._text)]
            self._ids = list(parent._ids)
            self._pending = []
            self._text = list(parent._text)
            self._vars = dict(parent._vars)
            self._meta = dict(parent._meta)
            self._messages = [dict(m) for m in parent._messages]
            self._role = parent._role
            self._role_buf = list(parent._role_buf)
            self._any_role = parent._any_role
            self._fork_text_len = len(parent._text[0])
        prog.states.append(self)

    # ------------------------------------------------------------------ appending
    def __iadd__(self, expr: Any) -> "ProgramState":
        self._push(expr)
        return self

    def _push(self, expr: Any) -> None:
        if self._prog.done.is_set():
            raise ProgramError("this program has finished; its state can be read but not extended")
        if self._error is not None:
            raise self._error
        for leaf in flatten(as_expr(expr)):
            if self._op is not None or self._queue:
                self._queue.append(leaf)
            else:
                self._exec(leaf)

    def _exec(self, leaf: Expr) -> None:
        kind = type(leaf)  # identity tests on the exact type; subclasses take the isinstance route
        if kind is Text:
            self._append_text(leaf.text)
        elif kind is RoleBegin:
            self._role_begin(leaf.role)
        elif kind is RoleEnd:
            self._role_end(leaf.role)
        elif kind is Gen:
            self._start_gen(leaf)
        elif kind is Select:
            self._start_select(leaf)
        else:
            self._exec_subclass(leaf)

    def _exec_subclass(self, leaf: Expr) -> None:
        if isinstance(leaf, Text):
            self._append_text(leaf.text)
        elif isinstance(leaf, Gen):
            self._start_gen(leaf)
        elif isinstance(leaf, Select):
            self._start_select(leaf)
        elif isinstance(leaf, RoleBegin):
            self._role_begin(leaf.role)
        elif isinstance(leaf, RoleEnd):
            self._role_end(leaf.role)
        else:  # pragma: no cover - as_expr only builds the kinds above
            raise InvalidRequestError(f"unknown expression {leaf!r}")

    def _drain(self) -> None:
        """Run queued expressions after an op finished."""
        try:
            while self._queue and self._op is None:
                self._exec(self._queue.popleft())
        except Exception as e:
            self._set_error(e)
        if self._op is None:
            self._prog.runtime.state_idle(self)

    def _set_error(self, exc: BaseException) -> None:
        self._error = exc
        self._queue.clear()
        self._op = None

    # ------------------------------------------------------------------ interface for the runtime / ops
    @property
    def program(self) -> "Program":
        """The program invocation this state belongs to."""
        return self._prog

    @property
    def current_op(self) -> Any:
        """The op this state waits on (None when none is in flight)."""
        return self._op

    @property
    def failure(self) -> BaseException | None:
        """The error that failed this state (its own, not the program's)."""
        return self._error

    @property
    def streaming(self) -> bool:
        """True when the state streams text chunks (run(..., stream=True))."""
        return self._chunks is not None

    def idle(self) -> bool:
        """Nothing in flight and nothing queued."""
        return self._op is None and not self._queue

    def fail(self, exc: BaseException) -> None:
        """Fail the state with `exc` (its queue is dropped) and tell the runtime it is idle."""
        self._set_error(exc)
        self._prog.runtime.state_idle(self)

    def abandon(self) -> Any:
        """Drop what is queued and in flight (the program ended); returns the op that was in flight."""
        op, self._op = self._op, None
        self._queue.clear()
        return op

    def stream_delta(self, name: str | None, text: str) -> None:
        """A generated text delta of variable `name` (streamed states only)."""
        if self._chunks is not None:
            self._emit(name, text)

    def _append_text(self, text: str, into_role: bool = True) -> None:
        if into_role and self._role is not None and not self._role_buf and self._be.role_format.trim:
            text = text.lstrip()  # the template trims turn contents
        if not text:
            return
        self._text.append(text)
        self._pending.append(text)
        if into_role and self._role is not None:
            self._role_buf.append(text)
        if self._chunks is not None:
            self._emit(None, text)

    def _flush_ids(self) -> list[int]:
        """Tokenise pending text onto the ids (BOS first when the model wants one)."""
        if self._pending:
            new = self._be.encode("".join(self._pending))
            self._pending.clear()
            if not self._ids and self._be.bos_token_id is not None and (not new or new[0] != self._be.bos_token_id):
                new.insert(0, self._be.bos_token_id)
            self._ids.extend(new)
        elif not self._ids and self._be.bos_token_id is not None:
            self._ids.append(self._be.bos_token_id)
        return self._ids

    # ------------------------------------------------------------------ roles
    def _role_begin(self, role: str) -> None:
        fmt = self._be.role_format
        if not fmt.supports(role):
            raise InvalidRequestError(f"this model's chat template has no {role!r} role")
        if self._role is not None:
            raise ProgramError(f"cannot open a {role!r} turn while the {self._role!r} turn is open")
        text = ("" if self._any_role else fmt.start[role]) + fmt.prefix[role]
        self._any_role = True
        self._append_text(text, into_role=False)
        self._role, self._role_buf = role, []

    def _role_end(self, role: str) -> None:
        if self._role != role:
            raise ProgramError(f"cannot close a {role!r} turn: the open turn is {self._role!r}")
        if self._be.role_format.trim:
            self._trim_role_tail()
        self._messages.append({"role": role, "content": "".join(self._role_buf)})
        self._role, self._role_buf = None, []
        self._append_text(self._be.role_format.suffix[role], into_role=False)

    def _trim_role_tail(self) -> None:
        """Drop trailing whitespace of the closing turn, if it is still untokenised text.

        (Whitespace the model generated at the end of a turn is already in the token ids and
        stays: the ids must remain what the engine produced.)
        """
        content = "".join(self._role_buf)
        k = len(content) - len(content.rstrip())
        if k == 0 or sum(len(p) for p in self._pending) < k or not "".join(self._pending).endswith(content[-k:]):
            return
        for pieces in (self._pending, self._text, self._role_buf):
            left = k
            while left:
                last = pieces.pop()
                if len(last) > left:
                    pieces.append(last[: len(last) - left])
                    left = 0
                else:
                    left -= len(last)

    # ------------------------------------------------------------------ gen / select
    def _start_gen(self, g: Gen) -> None:
        fields = {**self._prog.defaults, **g.sampling}
        if g.return_logprob:
            fields["logprobs"] = fields.get("logprobs") or 0
        params = self._be.make_params(**fields)
        if g.n is not None:
            seed = params.seed
            many = [params if seed is None or i == 0 else self._be.make_params(**{**fields, "seed": seed + i})
                    for i in range(g.n)]
            self._op = MultiGenOp(self, g, many, list(self._flush_ids()))
        else:
            self._op = GenOp(self, g, params, list(self._flush_ids()), streaming=self._chunks is not None)
        self._prog.runtime.enqueue(self._op)

    def _start_select(self, sel: Select) -> None:
        prompt = list(self._flush_ids())
        choice_ids = [self._be.encode(c) for c in sel.choices]
        for c, ids in zip(sel.choices, choice_ids):
            if not ids:
                raise InvalidRequestError(f"select choice {c!r} encodes to no tokens")
        self._op = SelectOp(self, sel, prompt, choice_ids, self._be.bos_token_id)
        self._prog.runtime.enqueue(self._op)

    # ------------------------------------------------------------------ what the runtime delivers
    def deliver(self, event: Event) -> None:
        """An event of the op this state waits on (ops.py), delivered by the runtime."""
        if isinstance(event, Streamed):
            self.stream_delta(event.name, event.text)
        elif isinstance(event, GenDone):
            self.finish_gen(event.op, event.out)
        elif isinstance(event, GenNDone):
            self.finish_gen_n(event.op, event.outs)
        elif isinstance(event, SelectDone):
            self.finish_select(event.op, event.index, event.meta)
        else:
            raise ProgramError(f"internal: a state cannot take {type(event).__name__}")

    def op_failed(self, op: Op, exc: BaseException) -> None:
        """An op of this state cannot complete (submission error, engine error, bug): the state
        fails if it still waits on that op."""
        if self._op is op:
            self.fail(exc)

    def finish_gen(self, op: GenOp, out: Any) -> None:
        """The gen op's request finished with `out`: append its tokens/text, set its variable."""
        self._op = None
        name = op.expr.name
        text = out.text
        try:
            if getattr(out, "valid", None) is False:  # an approximated grammar let an invalid value through
                raise ProgramError(f"gen {name!r}: output {text[:200]!r} does not satisfy its JSON schema: "
                                   f"{getattr(out, 'violation', None)}")
            value = decode_value(name, op.params, text)
        except ProgramError as e:
            self.fail(e)
            return
        ids = list(out.token_ids)
        if ids and out.finish_reason == "stop" and (
            ids[-1] in self._be.eos_token_ids or ids[-1] in op.params.stop_token_ids
        ):
            ids.pop()  # the finishing stop token: not in the text; the role suffix re-adds it
        rest = ""
        if ids and self._be.decode(ids) != text:
            # the engine cut text off (stop string): keep only the tokens the kept text covers
            while ids and not text.startswith(self._be.decode(ids)):
                ids.pop()
            rest = text[len(self._be.decode(ids)):] if ids else text
        elif not ids:
            rest = text
        self._ids.extend(ids)
        if rest:
            self._pending.append(rest)
        if text:
            self._text.append(text)
            if self._role is not None:
                self._role_buf.append(text)
        if self._chunks is not None:
            if text.startswith(op.streamed) and len(text) > len(op.streamed):
                self._emit(name, text[len(op.streamed):])
            self._emit(name, None)
        if name is not None:
            meta = {
                "prompt_tokens": len(op.prompt),
                "completion_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "output_token_ids": list(out.token_ids),
                "text": text,
                "grammar_backend": out.grammar_backend,
                "grammar_approximated": list(getattr(out, "grammar_approximated", None) or []),
                "valid": getattr(out, "valid", None),
                "num_cached_tokens": out.num_cached_tokens,
            }
            if op.expr.return_logprob:
                meta.update(self._logprob_meta(op, out))
            self._set_var(name, value, meta)
        self._drain()

    def _logprob_meta(self, op: Any, out: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "logprobs": [lp.logprob for lp in (out.logprobs or [])],
            "top_logprobs": [lp.top for lp in (out.logprobs or [])],
        }
        if op.expr.logprob_text:
            meta["logprob_tokens"] = [self._be.decode([t]) for t in out.token_ids]
        if op.params.prompt_logprobs is not None and out.prompt_logprobs is not None:
            start = op.params.prompt_logprobs_start
            meta["input_token_logprobs"] = [None if lp is None else lp.logprob for lp in out.prompt_logprobs[start:]]
        return meta

    def finish_gen_n(self, op: Any, outs: list[Any]) -> None:
        """gen(n=k) finished: the variable is the list of the k values; the text is unchanged."""
        self._op = None
        name = op.expr.name
        try:
            values = [decode_value(name, op.params, out.text) for out in outs]
        except ProgramError as e:
            self.fail(e)
            return
        if self._chunks is not None:
            self._emit(name, None)
        if name is not None:
            metas = [{"prompt_tokens": len(op.prompt), "completion_tokens": len(out.token_ids),
                      "finish_reason": out.finish_reason, "text": out.text,
                      "num_cached_tokens": out.num_cached_tokens,
                      **(self._logprob_meta(op, out) if op.expr.return_logprob else {})} for out in outs]
            self._set_var(name, values, metas)
        self._drain()

    def finish_select(self, op: SelectOp, index: int, meta: dict[str, Any]) -> None:
        """The select op decided on choice `index`: append it, set its variable."""
        self._op = None
        choice = op.expr.choices[index]
        self._ids.extend(op.choice_ids[index])
        self._text.append(choice)
        if self._role is not None:
            self._role_buf.append(choice)
        if self._chunks is not None:
            self._emit(op.expr.name, choice)
            self._emit(op.expr.name, None)
        if op.expr.name is not None:
            self._set_var(op.expr.name, choice, meta)
        self._drain()

    def _set_var(self, name: str, value: Any, meta: dict[str, Any] | None) -> None:
        self._vars[name] = value
        self._meta[name] = meta
        self._assigned.append(name)

    # ------------------------------------------------------------------ streaming
    def _emit(self, var: str | None, text: str | None) -> None:
        with self._prog.cv:
            self._chunks.append((var, text))
            self._prog.cv.notify_all()

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Yield text as it is generated: all text (name=None) or one variable's deltas.

        Live only for `run(..., stream=True)`; on a non-streamed state it yields the final text
        (or the variable's text) once.
        """
        if self._chunks is None:
            self._sync()
            if name is None:
                yield self.text()
            elif isinstance(self._meta.get(name), dict) and "text" in self._meta[name]:
                yield self._meta[name]["text"]
            elif name in self._vars:
                yield str(self._vars[name])
            return
        cv, i = self._prog.cv, 0
        while True:
            with cv:
                while i >= len(self._chunks) and not self._prog.done.is_set():
                    cv.wait(0.5)
                new, i = self._chunks[i:], len(self._chunks)
                done = self._prog.done.is_set() and i >= len(self._chunks)
            for var, piece in new:
                if name is None:
                    if piece:
                        yield piece
                elif var == name:
                    if piece is None:
                        return
                    yield piece
            if done:
                return

    # ------------------------------------------------------------------ reading
    def _sync(self, states: "list[ProgramState] | None" = None) -> None:
        """Wait until `states` (default: self) have executed everything appended to them."""
        states = states or [self]
        prog = self._prog
        if prog.greenlet is not None and greenlet.getcurrent() is prog.greenlet:
            prog.runtime.wait(prog, states)
            for st in states:
                if st.failure is not None:
                    raise st.failure
        elif not prog.done.is_set():
            if prog.runtime.in_loop_thread():
                raise ProgramError("a program's state was read outside of its own program while it runs")
            prog.done.wait()

    def __getitem__(self, name: str) -> Any:
        self._sync()
        try:
            return self._vars[name]
        except KeyError:
            raise KeyError(f"no variable {name!r} in this state (have: {sorted(self._vars)})") from None

    def __setitem__(self, name: str, value: Any) -> None:
        self._sync()
        self._set_var(name, value, None)

    def __contains__(self, name: str) -> bool:
        self._sync()
        return name in self._vars

    def get_var(self, name: str) -> Any:
        """Same as `s[name]`."""
        return self[name]

    def get_meta_info(self, name: str) -> Any:
        """Per-variable details: prompt/completion tokens, finish_reason, logprobs (when asked),
        grammar_backend, num_cached_tokens; for select the scores; a list after a join."""
        self._sync()
        if name not in self._meta:
            raise KeyError(f"no variable {name!r} in this state")
        return self._meta[name]

    def text(self) -> str:
        """The whole program text so far (chat-template markup included)."""
        self._sync()
        return "".join(self._text)

    def token_ids(self) -> list[int]:
        """The prompt as token ids (what the next request would send)."""
        self._sync()
        if self._prog.done.is_set() and self._pending:
            return list(self._ids) + self._be.encode("".join(self._pending))
        return list(self._flush_ids())

    def messages(self) -> list[dict[str, str]]:
        """Closed chat turns as [{"role", "content"}]."""
        self._sync()
        return [dict(m) for m in self._messages]

    def variables(self) -> dict[str, Any]:
        """All variables (a copy)."""
        self._sync()
        return dict(self._vars)

    def error(self) -> BaseException | None:
        """The exception that ended this program (or failed this fork), else None."""
        return self._prog.error if self is self._prog.state else (self._error or self._prog.error)

    @property
    def ok(self) -> bool:
        """True when the program finished without an error."""
        return self._prog.done.is_set() and self.error() is None

    # ------------------------------------------------------------------ chat-role helpers
    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` appends a system turn; `with s.system():` opens one."""
        return self._role_helper("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role_helper("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role_helper("assistant", expr)

    def _role_helper(self, role: str, expr: Any) -> Any:
        if expr is None:
            return _RoleBlock(self, role)
        self._push(Seq([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
        return None

    # ------------------------------------------------------------------ fork / join
    def fork(self, n: int = 1) -> "ForkGroup":
        """n child states continuing from this one (same tokens, text, variables, open turn).

        The children's requests reuse this state's tokens from the engine's prefix cache.
        """
        if not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"fork needs an int n >= 1, got {n!r}")
        self._sync()
        self._flush_ids()
        return ForkGroup(self, [ProgramState(self._prog, parent=self) for _ in range(n)])

    def join(self, children: "list[ProgramState]", mode: str = "gather") -> None:
        """Wait for `children` (from fork) and bring their results into this state.

        mode="gather" (default): every variable a child set after the fork becomes a list over
        the children in this state (`s[name] -> [child0's, child1's, ...]`, None where a child
        did not set it; meta info likewise). mode="concat": additionally append each child's
        text since the fork to this state, in order.
        """
        if mode not in ("gather", "concat"):
            raise InvalidRequestError(f"join mode must be 'gather' or 'concat', got {mode!r}")
        children = list(children)
        self._sync(children)
        names: list[str] = []
        for c in children:
            for k in c._assigned:
                if k not in names:
                    names.append(k)
        for k in names:
            self._set_var(k, [c._vars.get(k) for c in children], [c._meta.get(k) for c in children])
        if mode == "concat":
            self._push("".join("".join(c._text)[c._fork_text_len:] for c in children))

    def copy(self) -> "ProgramState":
        """SGLang's `s.copy()`: one fork of this state (same tokens, text, variables)."""
        return self.fork(1)[0]

    def var_scope(self, name: str) -> "_VarScope":
        """`with s.var_scope("x"): s += ...` stores the text appended inside the block in `s["x"]`."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"var_scope needs a non-empty variable name, got {name!r}")
        return _VarScope(self, name)

    async def text_async_iter(self, name: str | None = None) -> Any:
        """`text_iter` for asyncio: `async for piece in state.text_async_iter(): ...`."""
        import asyncio

        it = self.text_iter(name)
        loop = asyncio.get_running_loop()
        done = object()
        while True:
            piece = await loop.run_in_executor(None, next, it, done)
            if piece is done:
                return
            yield piece

    def __repr__(self) -> str:
        status = "running" if not self._prog.done.is_set() else ("ok" if self.error() is None else "error")
        return f"<ProgramState {status} vars={sorted(self._vars)}>"


class ForkGroup(list):
    """The children of `s.fork(n)`: a list of states with group helpers.

    `group += expr` appends to every child; `group["x"]` is the list of the children's values;
    `group.join()` is `parent.join(group)`.
    """

    def __init__(self, parent: ProgramState, children: list[ProgramState]) -> None:
        super().__init__(children)
        self.parent = parent

    def __iadd__(self, expr: Any) -> "ForkGroup":  # type: ignore[override]
        for c in self:
            c += expr
        return self

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            states = list(self)
            if states:
                states[0]._sync(states)
            return [c._vars.get(key) for c in states]
        return super().__getitem__(key)

    def join(self, mode: str = "gather") -> None:
        """Gather the children's variables into the parent (see ProgramState.join)."""
        self.parent.join(list(self), mode=mode)


class _Detached:
    """The minimum of a Program a state needs to render text without running (see render_prefix)."""

    def __init__(self, backend: Any) -> None:
        import threading

        self.backend, self.stream, self.states, self.defaults = backend, False, [], {}
        self.done = threading.Event()
        self.runtime = None


def render_prompt(backend: Any, leaves: list[Expr]) -> list[int]:
    """Token ids of text / role leaves rendered exactly as a program's state renders them (BOS,
    chat-template role text, trimming); for the runtime's prefix plan."""
    st = ProgramState(_Detached(backend))  # type: ignore[arg-type]
    for leaf in leaves:
        st._exec(leaf)
    return list(st._flush_ids())
