"""Per-request admission of an SGLang server (0.5.14 to 0.5.23; PR_EAGLE3, EAGLE3 and plain), and each `PR_EAGLE3`
response's own `meta_info`.

Refusals. SGLang 0.5.14 validates a request's sampling parameters in the tokenizer manager
(`SamplingParams.verify`) and, per speculative algorithm, in the scheduler (`Scheduler.handle_generate_request`:
DFLASH's `validate_dflash_request`, then `Req.set_finish_with_abort`, which answers the client with HTTP 400 and the
message); it has no such hook for a registered (custom) algorithm. So the plugin's entry point registers, through
SGLang's own plugin hook registry (`sglang.srt.plugins.hook_registry.HookRegistry`, applied by `load_plugins` in
the scheduler's process), a BEFORE hook on `Scheduler._add_request_to_queue`, the one door every generate
request (new, session, retracted) goes through: `admit` refuses there, through `Req.set_finish_with_abort` (SGLang's
own abort path: HTTP 400, one line naming the field; the request never runs, every other request is untouched):
  * on a speculative server on a CPU, a request SGLang would sample (`SamplingParams.top_k > 1` after its own
    normalisation, i.e. temperature > 0 without top_k 1): 0.5.14's sampling verify (`eagle_sample`) needs
    sgl-kernel's CUDA ops, and one such request killed the scheduler (`sampling_error`);
  * on a `PR_EAGLE3` server, a malformed `custom_params["pr_eagle3"]` (`request_shape_error`): not an object, an
    unknown key, a value that is not an integer, m < 0, B_w < 1, B_w above B (a frontier row past the B best of
    its step never reaches the cut), a tree that cannot fill B nodes, m above the pool's reach
    (1 + (gamma - 2) B_w rows: the most nodes a round can ever have pooled), and, on the `sglang` row path,
    rows beyond the draft KV slots SGLang reserves per request (`checks.rows_room`). Nothing is clamped: a value
    out of range is refused.
The scheduler computes the server's limits from its own arguments (`limits`, once per process).

Prompts. An empty prompt (`{"text": ""}`) crashes SGLang 0.5.23's prefill (it tokenizes to nothing; llama's rotary
embedding cannot reshape 0 elements, and SGLang then kills the whole server), plain, EAGLE3 and PR_EAGLE3 servers
alike; 0.5.14 refuses it itself, in words that name no field. So `install` also registers BEFORE hooks, in the
HTTP server's process, before anything is sent to the scheduler, on `TokenizerManager._tokenize_texts`
(`check_texts`: an empty `text`, before it is tokenized) and on SGLang's own length check after tokenization,
`TokenizerManager._validate_one_request` (`check_prompt`: a prompt of no token, and a prompt whose tokens, with the
slots SGLang reserves for drafts, do not fit the context: SGLang's own refusal of it is one line but names no field;
with `--allow-auto-truncate` SGLang truncates instead, and nothing is refused). Each raises a ValueError, which
SGLang's `/generate` answers with HTTP 400 and the one line. SGLang refuses an empty `input_ids` list itself
(`GenerateReqInput`, one line). `admit` refuses an empty prompt again in the scheduler, should one reach it another
way. A body that is not JSON, or whose fields have the wrong type, never reaches the tokenizer manager: FastAPI
refuses it before SGLang's endpoint runs, and SGLang's handler answers with a multi-line dump naming a server file.
`install` puts `body_refusal` before that handler (`install_body_refusal`, when SGLang's HTTP module is imported):
for `/generate`, one line naming the field, in `/generate`'s `{"error": {"message": ...}}` form; every other route
keeps SGLang's answer.
The plugin's entry point calls `install` in every SGLang process; the CPU bridge (`sglang_cpu.bridge`) calls it too
(on import of `sglang.srt.plugins`), so a server the bridge runs refuses the same without the serving install.

Meta info. SGLang carries per-token extras from the scheduler to the response through `Req.customized_info`
(`{key: [one entry per output token]}`, sliced per sent chunk by the output streamer and accumulated into
`meta_info[key]` by the tokenizer manager). Every request a `PR_EAGLE3` scheduler admits gets the key `pr_eagle3`
(the streamer's lists are per batch, so all requests of a batch must carry it); entry `i` is the request's state
after the round that emitted output token `i`: `{"bw", "m", "rounds", "recon_rows", "recon_kept"}` (effective B_w
and m; verified rounds; reconsideration rows run and reconsidered nodes kept, summed over those rounds). The last
entry is the request's total: `meta_info["pr_eagle3"][-1]`, whose `rounds` equals SGLang's `spec_verify_ct`.
The worker records a round (`record_round`) when SGLang has its verify result on the host
(`on_verify_complete_cpu`), for requests SGLang counts the round for (not finished, not retracted).

Does not own: the server's shape and start-up refusals (`checks`), the round (`worker`).
"""

from __future__ import annotations

import logging
import re
from typing import Dict, Optional, Tuple

from pr_specforge.sglang_plugin.checks import (
    ALGORITHM, REQUEST_KEY, PRServeShape, overlap_on, read_export_config, rows_for,
    rows_room, serve_shape, tree_rows)

log = logging.getLogger(__name__)

META_KEY = REQUEST_KEY  # meta_info["pr_eagle3"]: one entry per output token, the last the request's total
REQUEST_FIELD = f"sampling_params.custom_params.{REQUEST_KEY}"
HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
PROMPT_HOOK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
TEXTS_HOOK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_texts"
HTTP_MODULE = "sglang.srt.entrypoints.http_server"
#: the route whose malformed bodies get `body_refusal`'s one line (every other route keeps SGLang's answer)
BODY_ROUTE = "/generate"
#: the worker's warning for a drafted round SGLang never reported verified (the fault test reads server logs for it)
UNREPORTED_LINE = "PR_EAGLE3: a drafted round's verify result never reached the worker (not in its requests' meta_info)"
_installed = False


class PRRequestError(ValueError):
    """A request this server cannot serve as asked (one line, naming the field)."""


def install() -> None:
    """Register `admit` and `check_prompt` with SGLang's hook registry (once per process; `load_plugins` applies
    them), and `body_refusal` on SGLang's HTTP app once its module is imported (`install_body_refusal`)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, admit, HookType.BEFORE)
    HookRegistry.register(PROMPT_HOOK_TARGET, check_prompt, HookType.BEFORE)
    HookRegistry.register(TEXTS_HOOK_TARGET, check_texts, HookType.BEFORE)
    _after_import(HTTP_MODULE, install_body_refusal)
    _installed = True


def sglang_line() -> str:
    """`SGLang 0.5.23`: the line this process runs on, as refusals name it."""
    from pr_specforge.sglang_plugin.seam import installed_version

    try:
        return f"SGLang {installed_version()}"
    except Exception:  # noqa: BLE001 - a refusal's wording must never fail the refusal
        return "SGLang"


# ----------------------------------------------------------------------------- prompts (the tokenizer manager)
def prompt_field(obj) -> str:
    """The request field a prompt came from: `input_ids` when the client sent token ids, else `text`."""
    return "input_ids" if getattr(obj, "input_ids", None) is not None else "text"


def prompt_error(field: str, n_tokens: int, context_len: int, reserved: int = 0, truncate: bool = False
                 ) -> Optional[str]:
    """Why a prompt of `n_tokens` cannot be served (None where it can): no token at all (SGLang's prefill of an
    empty prompt kills the server), or more than the context holds with the `reserved` slots SGLang keeps for a
    speculative request's drafts (`TokenizerManager.num_reserved_tokens`) - not when SGLang truncates (`truncate`:
    `--allow-auto-truncate`)."""
    if n_tokens == 0:
        return f"{field}: the prompt is empty (0 tokens after tokenization); send at least one token"
    if not truncate and n_tokens + reserved >= context_len:
        room = f": SGLang keeps {reserved} of the {context_len} for speculative drafts" if reserved else ""
        return (f"{field}: the prompt is {n_tokens} tokens after tokenization, too long for this server's context "
                f"length of {context_len} tokens (at most {max(context_len - reserved - 1, 0)} prompt tokens{room})")
    return None


def check_texts(tokenizer_manager, texts, *args, **kwargs) -> None:
    """The BEFORE hook of SGLang's `TokenizerManager._tokenize_texts(texts, ...)`: an empty `text` is refused with
    `prompt_error`'s line before it is tokenized (SGLang 0.5.14 refuses it there itself, as "texts cannot be empty
    and tokenizer must be initialized"; 0.5.23 tokenizes it to nothing, and `check_prompt` would see it after)."""
    if isinstance(texts, str) and texts == "" or isinstance(texts, list) and "" in texts:
        raise ValueError(prompt_error("text", 0, 1))
    return None


def check_prompt(tokenizer_manager, obj, input_ids, *args, **kwargs) -> None:
    """The BEFORE hook of SGLang's `TokenizerManager._validate_one_request(obj, input_ids)`: a ValueError (SGLang's
    HTTP 400, one line) for a prompt `prompt_error` refuses. A request without token ids (input embeddings) passes."""
    if input_ids is None:
        return None
    truncate = getattr(tokenizer_manager, "allow_auto_truncate", None)  # 0.5.23 keeps it here, 0.5.14 in server_args
    if truncate is None:
        truncate = getattr(getattr(tokenizer_manager, "server_args", None), "allow_auto_truncate", False)
    error = prompt_error(prompt_field(obj), len(input_ids), int(tokenizer_manager.context_len),
                         int(getattr(tokenizer_manager, "num_reserved_tokens", 0) or 0), bool(truncate))
    if error:
        raise ValueError(error)
    return None


# ----------------------------------------------------------------------------- bodies (SGLang's HTTP layer)
#: a union member's tag in a pydantic error's `loc` (`text.str`, `sampling_params.dict[any,any]`): not a field
_TYPE_TAG = re.compile(r"^(str|int|float|bool|bytes|dict|list|tuple|set|none|any)(\[.*\])?$")


def _field(loc) -> str:
    names = []
    for x in loc:
        if x == "body" and not names:
            continue
        if isinstance(x, str) and _TYPE_TAG.match(x):
            break
        names.append(f"[{x}]" if isinstance(x, int) else str(x))
    return ".".join(names).replace(".[", "[")


def body_error(errors) -> str:
    """One line for FastAPI's validation `errors` of a request body: not JSON (where it failed), or the first field
    at fault with what each alternative of its type said, and how many more fields were."""
    errors = list(errors or [])
    if not errors:
        return "request body: not a valid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        at = [x for x in first.get("loc", ()) if isinstance(x, int)]
        line = f"request body: not valid JSON ({why}{f' at character {at[0]}' if at else ''})"
    else:
        fields: Dict[str, list] = {}
        for e in errors:
            msgs = fields.setdefault(_field(e.get("loc", ())), [])
            if e.get("msg") and e["msg"] not in msgs:
                msgs.append(e["msg"])
        name, msgs = next(iter(fields.items()))
        if not name and first.get("type") in ("dataclass_type", "model_type", "dict_type", "model_attributes_type"):
            msgs = ["must be a JSON object"]
        more = len(fields) - 1
        line = (f"{name or 'request body'}: {' or '.join(msgs) or 'not valid'}"
                + (f" (and {more} more field{'s' * (more > 1)})" if more else ""))
    return " ".join(line.split())


def install_body_refusal(http_module) -> None:
    """Answer `/generate`'s body validation errors (FastAPI's `RequestValidationError`: not JSON, a field of the
    wrong type) with `body_error`'s one line, HTTP 400, in the form of `/generate`'s other refusals; every other
    route goes to the handler SGLang registered. Once per app."""
    from fastapi.exceptions import RequestValidationError
    from starlette.responses import JSONResponse

    app = getattr(http_module, "app", None)
    if app is None or getattr(app, "_pr_body_refusal", False):
        return
    sglangs = app.exception_handlers.get(RequestValidationError)

    async def body_refusal(request, exc):
        path = request.url.path.removeprefix(request.scope.get("root_path", "") or "")
        if path != BODY_ROUTE and sglangs is not None:
            return await sglangs(request, exc)
        return JSONResponse({"error": {"message": body_error(exc.errors())}}, status_code=400)

    app.add_exception_handler(RequestValidationError, body_refusal)
    app._pr_body_refusal = True


class _AfterImport:
    """A `sys.meta_path` finder that runs `then(module)` right after `name`'s body (once)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run_body, then = spec.loader.exec_module, self.then

        def exec_module(module):
            run_body(module)
            try:
                then(module)
            except Exception:  # noqa: BLE001 - SGLang's own handler stays
                log.exception("%s: could not install on %s", ALGORITHM, fullname)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name: str, then) -> None:
    """`then(module)` now if `name` is imported, else right after it is (in this process)."""
    import sys

    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def admit(scheduler, req, is_retracted: bool = False, *args, **kwargs) -> None:
    """The BEFORE hook of `Scheduler._add_request_to_queue`: refuse (`Req.set_finish_with_abort`) what this server
    cannot serve, and give a `PR_EAGLE3` request its meta-info key. A retracted or already finished request passes."""
    server_args = scheduler.server_args
    pr = getattr(server_args, "speculative_algorithm", None) == ALGORITHM
    if is_retracted or req.finished() or getattr(req, "to_finish", None) is not None:
        if pr:  # a request SGLang refused itself still carries the key (a batch's lists must align)
            start_meta(req, admitted_shape(req))
        return None
    shape = None
    try:
        error = empty_error(req) or sampling_error(server_args, req.sampling_params)
        if pr:
            shape, max_rows = limits(server_args)
            shape = request_shape(shape, req.sampling_params.custom_params, max_rows)
    except PRRequestError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a request must never stop the scheduler
        log.exception("%s: admission failed", ALGORITHM)
        error = f"{ALGORITHM}: the request could not be admitted ({type(e).__name__}: {e})".splitlines()[0]
    if pr:  # every request of this scheduler carries the key, refused ones too (a batch's lists must align)
        start_meta(req, shape)
    if error:
        req.set_finish_with_abort(error)
    return None


def empty_error(req) -> Optional[str]:
    """A prompt of no token that reached the scheduler (`check_prompt` refuses it before, where it ran); one that
    carries input embeddings or multimodal inputs instead passes."""
    if len(req.origin_input_ids or ()) or getattr(req, "input_embeds", None) is not None \
            or getattr(req, "multimodal_inputs", None) is not None:
        return None
    return prompt_error("input_ids", 0, 1)


def sampling_error(server_args, sampling_params) -> Optional[str]:
    """Why a speculative server on a CPU cannot serve `sampling_params` (None where it can): SGLang samples a request
    whose `top_k` is above 1 after its own normalisation (temperature 0 sets top_k 1)."""
    if getattr(server_args, "speculative_algorithm", None) is None or str(server_args.device) != "cpu":
        return None
    if int(sampling_params.top_k) <= 1:
        return None
    return (f"sampling_params.temperature {sampling_params.temperature:g} (top_k {_top_k(sampling_params.top_k)}): "
            f"this speculative server on a CPU verifies greedily only ({sampling_why(sglang_line())}); send "
            "temperature 0 or top_k 1")


def sampling_why(line: str) -> str:
    """Why `line` (`SGLang 0.5.14`) cannot sample-verify on a CPU: 0.5.14's verify calls sgl-kernel's CUDA ops;
    0.5.16+ calls its sampling op (`tree_speculative_sampling_target_only`), which has no CPU build here and no
    stand-in in the CPU bridge."""
    from pr_specforge.sglang_plugin.seam import version_tuple

    try:
        newer = version_tuple(line.split()[-1]) >= (0, 5, 16)
    except Exception:  # noqa: BLE001
        newer = False
    if newer:
        return f"{line}'s sampling verify needs sgl-kernel's sampling op, which the CPU bridge does not stand in for"
    return f"{line}'s sampling verify needs sgl-kernel's CUDA ops"


def _top_k(top_k: int) -> str:
    return "all" if top_k >= 1 << 30 else str(top_k)  # SGLang's TOP_K_ALL for -1


_LIMITS: Dict[int, Tuple[PRServeShape, Optional[int]]] = {}


def limits(server_args) -> Tuple[PRServeShape, Optional[int]]:
    """The server's shape and, on the `sglang` row path, the draft KV slots a request's rows may take (else None);
    read once per `server_args` (the export's config.json and the environment, as at start-up)."""
    key = id(server_args)
    if key not in _LIMITS:
        shape = serve_shape(server_args, read_export_config(server_args.speculative_draft_model_path))
        _LIMITS[key] = shape, rows_room(shape, overlap_on(server_args)) if rows_for(server_args) == "sglang" else None
    return _LIMITS[key]


def _int_field(own: dict, name: str, default: int) -> int:
    value = own.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PRRequestError(f"{REQUEST_FIELD}.{name} must be an integer, got {value!r}")
    return value


def request_shape(shape: PRServeShape, custom_params, max_rows: Optional[int] = None) -> PRServeShape:
    """`shape` with a request's own B_w / m (`custom_params["pr_eagle3"]`; k, gamma and B stay the server's);
    PRRequestError (one line, naming the field) for anything this server cannot serve as asked."""
    if not isinstance(custom_params, dict) or custom_params.get(REQUEST_KEY) is None:
        return shape
    own = custom_params[REQUEST_KEY]
    if not isinstance(own, dict):
        raise PRRequestError(f"{REQUEST_FIELD} must be an object {{\"bw\": int, \"m\": int}}, got {own!r}")
    unknown = sorted(set(own) - {"bw", "m"})
    if unknown:
        raise PRRequestError(f"{REQUEST_FIELD} has unknown key(s) {', '.join(map(repr, unknown))} (known: bw, m)")
    bw, m = _int_field(own, "bw", shape.bw), _int_field(own, "m", shape.m)
    top_bw = max(shape.budget, shape.bw)
    if not 1 <= bw <= top_bw:
        raise PRRequestError(f"{REQUEST_FIELD}.bw {bw} is outside [1, {top_bw}] (B = {shape.budget}: a frontier row "
                             "past the B best of its step never reaches the cut)")
    asked = PRServeShape(k=shape.k, bw=bw, m=m, gamma=shape.gamma, budget=shape.budget)
    if asked.guaranteed_nodes() < shape.budget:
        raise PRRequestError(f"{REQUEST_FIELD}.bw {bw}: the tree (k {shape.k}, gamma {shape.gamma}) holds only "
                             f"{asked.guaranteed_nodes()} nodes for sure, fewer than B = {shape.budget}")
    top_m = max(1 + max(shape.gamma - 2, 0) * bw, shape.m)
    if m < 0 or m > top_m:
        raise PRRequestError(f"{REQUEST_FIELD}.m {m} is outside [0, {top_m}] (at B_w {bw} and gamma {shape.gamma} a "
                             f"round pools at most {top_m} nodes)")
    if max_rows is not None and tree_rows(asked) > max_rows:
        name = "m" if "m" in own else "bw"
        raise PRRequestError(f"{REQUEST_FIELD}.{name} {getattr(asked, name)}: a round's (gamma - 1)(B_w + m) = "
                             f"{tree_rows(asked)} tree rows exceed the {max_rows} draft KV slots this server reserves "
                             "per request")
    return asked


def _entry(shape: Optional[PRServeShape], rounds: int = 0, recon_rows: int = 0, recon_kept: int = 0) -> dict:
    bw, m = (shape.bw, shape.m) if shape is not None else (None, None)
    return {"bw": bw, "m": m, "rounds": rounds, "recon_rows": recon_rows, "recon_kept": recon_kept}


def _slack(shape: Optional[PRServeShape]) -> int:
    """Entries kept past the emitted tokens: a round emits at most gamma + 1, a re-prefill after retraction one."""
    return (shape.gamma if shape is not None else 1) + 2


def start_meta(req, shape: Optional[PRServeShape]) -> None:
    """A request's meta-info key at admission: its effective B_w and m, no round yet (`req.pr_shape` = its shape;
    None for a request admission could not read, which is refused)."""
    if shape is not None:
        req.pr_shape = shape
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(META_KEY, [_entry(shape)] * _slack(shape))


def admitted_shape(req) -> Optional[PRServeShape]:
    """The shape `admit` gave the request (None where it did not run)."""
    return getattr(req, "pr_shape", None)


def worker_shape(req, shape: PRServeShape, max_rows: Optional[int]) -> PRServeShape:
    """The shape the worker drafts `req` at: the one `admit` gave it; where admission did not run (the hook not
    applied in this process), the request's own (`request_shape`), or the server's if that is refused (logged: a
    request must not stop the scheduler; its meta info then has no `pr_eagle3` key)."""
    admitted = admitted_shape(req)
    if admitted is not None:
        return admitted
    try:
        admitted = request_shape(shape, getattr(req.sampling_params, "custom_params", None), max_rows)
    except PRRequestError as e:
        log.warning("%s: request %s not admitted, drafted at the server's shape: %s", ALGORITHM, req.rid, e)
        admitted = shape
    req.pr_shape = admitted
    return admitted


def record_round(req, recon_rows: int, recon_kept: int) -> None:
    """A verified round of `req` into its meta info: the entries of the tokens it emits (and the slack after them)
    are its new state; the entries of tokens already emitted stay."""
    info = (req.customized_info or {}).get(META_KEY)
    shape = admitted_shape(req)
    if info is None or shape is None:
        return
    last = info[-1]
    now = _entry(shape, last["rounds"] + 1, last["recon_rows"] + int(recon_rows), last["recon_kept"] + int(recon_kept))
    del info[len(req.output_ids):]
    info.extend([now] * _slack(shape))
