"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers sensibly."""

from deepinfer import SamplingParams


def test_default_model_knows_the_capital_of_france(default_engine):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_engine.generate([msgs], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends its turn with <|im_end|>, not by running out of tokens


def test_default_model_batch_matches_alone(default_engine):
    prompts = [
        [{"role": "user", "content": q}]
        for q in ("Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a planet.")
    ]
    sp = SamplingParams(temperature=0, max_tokens=12)
    batched = [o.token_ids for o in default_engine.generate(prompts, sp)]
    alone = [default_engine.generate([p], sp)[0].token_ids for p in prompts]
    assert batched == alone
