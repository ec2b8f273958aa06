"""vLLM's front end in the worker, lighter per request: what it works out again for every request
although it cannot change while the engine is up, worked out once (workers/engine/vllm.py calls
`lighten` when its AsyncLLM is built).

Under one-token requests with logprobs the engine host's loop is most of the worker's time, and
vLLM 0.32's front end spent ~19% of that loop on three such things (py-spy,
docs/performance.md, "The seventh pass"):

- Each top logprob's string: `convert_ids_list_to_tokens` decodes every token id alone, through
  the tokenizer's pool of copies (a queue borrow and return per id). A token id's string is the
  same for every request of a tokenizer, so the strings are kept per tokenizer
  (`TokenStrings`) and each id is decoded once.
- The end-of-sequence id: `renderer.get_eos_token_id()` per request goes through transformers'
  special-token lookup (`__getattr__`, then `convert_tokens_to_ids` through the pool). It is
  read once here and the renderer answers it from then on.
- vLLM's environment (`vllm.envs`): each SamplingParams reads a few variables from os.environ.
  vLLM caches them itself in EngineCore once it is initialized (`enable_envs_cache`); the worker
  does the same once its engine is up (its environment is set before vLLM is imported:
  workers/engine/vllm_args.py `engine_env_defaults`), and lets go of the cache when the engine
  shuts down.

Each cut is made only where this vLLM has the part it replaces; the results are the same
(tests/test_engine_front_end.py; the logprob strings also against a bare AsyncLLM in
tests/test_generation_contract_e2e.py).
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger("vigil.engine")

# Where vLLM's logprobs processor finds the function that turns token ids into strings.
LOGPROBS_MODULE = "vllm.v1.engine.logprobs"
CONVERT = "convert_ids_list_to_tokens"
# The attribute of a tokenizer that holds its strings (read from its __dict__: transformers'
# __getattr__ is slow for a missing name).
STRINGS_ATTR = "_vigil_token_strings"


class TokenStrings:
    """`convert_ids_list_to_tokens` with each (tokenizer, token id)'s string kept: the same list
    of strings as the function it wraps, each id decoded by it once per tokenizer."""

    def __init__(self, convert):
        self.convert = convert  # vLLM's own function

    def __call__(self, tokenizer, token_ids: list[int]) -> list[str]:
        """The strings of `token_ids` (in order), as vLLM's function gives them."""
        known = tokenizer.__dict__.get(STRINGS_ATTR)
        if known is None:
            known = {}
            setattr(tokenizer, STRINGS_ATTR, known)
        missing = [t for t in token_ids if t not in known]
        if missing:
            known.update(zip(missing, self.convert(tokenizer, missing)))
        return [known[t] for t in token_ids]


def lighten(llm) -> list[str]:
    """Make each cut of the module docstring that this vLLM allows on `llm` (an AsyncLLM just
    built); the names of those made. Never raises: a cut that does not fit is left out."""
    made = []
    for name, cut in (("token strings", _token_strings), ("eos id", _eos_once),
                      ("environment", _envs_cached)):
        try:
            if cut(llm):
                made.append(name)
        except Exception as e:  # noqa: BLE001 - vLLM's front end as it is stays correct
            log.info("vLLM's front end keeps its own %s (%s: %s)", name, type(e).__name__, e)
    return made


def release() -> None:
    """Let go of the environment cache (`lighten`'s): the engine is shutting down, and a later
    one, or an operator's tool in this process, reads the environment as it is then."""
    try:
        import vllm.envs as envs
    except ImportError:
        return
    if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()


def _token_strings(llm) -> bool:
    module = importlib.import_module(LOGPROBS_MODULE)
    convert = getattr(module, CONVERT, None)
    if convert is None:
        return False
    if not isinstance(convert, TokenStrings):
        setattr(module, CONVERT, TokenStrings(convert))
    return True


def _eos_once(llm) -> bool:
    renderer = getattr(llm, "renderer", None)
    read = getattr(renderer, "get_eos_token_id", None)
    if read is None or getattr(renderer, "tokenizer", None) is None:
        return False
    eos = read()

    def get_eos_token_id():
        return eos

    renderer.get_eos_token_id = get_eos_token_id
    return True


def _envs_cached(llm) -> bool:
    import vllm.envs as envs

    if not hasattr(envs, "enable_envs_cache"):
        return False
    envs.enable_envs_cache()
    return True
