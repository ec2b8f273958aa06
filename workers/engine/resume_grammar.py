"""The grammar of a run continuing a checkpoint starts where the generated prefix left it
(docs/api.md, "Resume"), inside EngineCore.

vLLM compiles a request's structured-output grammar in EngineCore (its StructuredOutputManager)
and masks the logits with it before the sampler, so the logprobs a request gets are those of
the masked logits. A continuing run asks for the same constraint; this hook then feeds the
grammar the tokens that end its prompt and were generated (resume_marks.Marks.made), as vLLM's
scheduler fed them to the first run's grammar one step at a time (`accept_tokens`, which stops
at the grammar's end as the scheduler's calls do). The mask, its place before the sampler and
the logprobs are then vLLM's own, the same as an unbroken run's; every backend's grammar has
`accept_tokens`.

Installed on vLLM's class by `install`, which the logits processor of
workers/engine/resume_steps.py calls where vLLM builds it: in EngineCore's model runner,
EngineCore itself when the model runs there (the layout Vigil asks for on the CPU, and vLLM's
own with one GPU: workers/engine/resume.py `grammar_resumes`). Imported only by that module (vLLM at the top, as it).
"""
from __future__ import annotations

from vllm.v1.structured_output import StructuredOutputManager

from workers.engine.resume_marks import read

_HOOKED = "_vigil_resumes_prefix"


def install() -> None:
    """Hook StructuredOutputManager's grammar creation (once per process): a continuing run's
    grammar accepts the generated tokens at its prompt's end before its first step. A grammar
    that refuses them fails the request (vLLM ends it with finish_reason "error")."""
    if getattr(StructuredOutputManager._create_grammar, _HOOKED, False):
        return
    create = StructuredOutputManager._create_grammar

    def _create_grammar(self, request):
        grammar = create(self, request)
        params = request.sampling_params
        marks = read(params.extra_args if params is not None else None)
        if marks is not None and marks.made:
            prefix = list(request.prompt_token_ids or ())[-marks.made:]
            if len(prefix) != marks.made or not grammar.accept_tokens(request.request_id,
                                                                      prefix):
                raise ValueError(f"the grammar refuses the {marks.made} tokens this run "
                                 "continues")
        return grammar

    setattr(_create_grammar, _HOOKED, True)
    StructuredOutputManager._create_grammar = _create_grammar

