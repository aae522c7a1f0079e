"""Prompts as the model expects them: an HF tokenizer (built offline, saved with a chat template) found in
--tokenizer or the --load-hf directory, its own chat template applied to string and message-list prompts,
--system-prompt, the stop tokens of generation_config.json, the vocabulary of a model started from scratch, and
the controller and reward stage using them."""

import json
import queue

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup, load_tokenizer
from megatron_rl.data.prompts import encode_prompt, stop_token_ids
from megatron_rl.data.tokenizer import DEFAULT_CHARS, build_char_tokenizer
from megatron_rl.models.spec import get_model_spec

SPECIAL = ["<|start|>", "<|sep|>", "<|eot|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|sep|>{{ m['content'] }}<|eot|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}")


def _save_tokenizer(directory, chat_template=TEMPLATE, words=()):
    tok = build_char_tokenizer(DEFAULT_CHARS + "?!")
    tok.add_tokens(SPECIAL, special_tokens=True)
    tok.add_tokens(list(words))
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def hf_dir(tmp_path):
    """An HF checkpoint directory as a user has it: config.json, the tokenizer, generation_config.json whose
    eos_token_id lists the end-of-turn token beside the tokenizer's EOS."""
    from transformers import AutoTokenizer

    directory = tmp_path / "model"
    _save_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    config = get_model_spec("tiny-llama").replace(vocab_size=len(tok)).to_hf_config()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")]}))
    return str(directory)


def test_the_chat_template_is_the_tokenizers_own(hf_dir):
    tok = load_tokenizer(parse_args(["--tokenizer", hf_dir, "--apply-chat-template"]))
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}]
    # The tokenizer's own rendering of the same chat, and the text the template writes, encoded as is.
    assert encode_prompt(tok, chat, True) == tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                     return_dict=False)
    assert encode_prompt(tok, chat, True) == tok.encode(
        "<bos><|start|>user<|sep|>2+2?<|eot|><|start|>assistant<|sep|>4<|eot|><|start|>user<|sep|>and 3+3?<|eot|>"
        "<|start|>assistant<|sep|>", add_special_tokens=False)
    # A string is one user message; --system-prompt leads, unless the prompt has its own system message.
    assert encode_prompt(tok, "2+2?", True, "Be brief.") == tok.encode(
        "<bos><|start|>system<|sep|>Be brief.<|eot|><|start|>user<|sep|>2+2?<|eot|><|start|>assistant<|sep|>",
        add_special_tokens=False)
    own = [{"role": "system", "content": "Think."}, {"role": "user", "content": "2+2?"}]
    assert encode_prompt(tok, own, True, "Be brief.") == tok.apply_chat_template(own, add_generation_prompt=True,
                                                                                 return_dict=False)
    # Without the template: BOS + text, and a chat cannot be encoded.
    assert encode_prompt(tok, "2+2?", False) == [tok.bos_token_id] + tok.encode("2+2?", add_special_tokens=False)
    with pytest.raises(ValueError, match="--apply-chat-template"):
        encode_prompt(tok, chat, False)


def test_the_tokenizer_defaults_to_the_load_hf_directory(hf_dir):
    from transformers import AutoTokenizer

    setup = build_run_setup(parse_args(["--load-hf", hf_dir, "--apply-chat-template"]), 2)
    reference = AutoTokenizer.from_pretrained(hf_dir)
    assert setup.tokenizer.get_vocab() == reference.get_vocab() and len(setup.tokenizer) > len(build_char_tokenizer())
    assert setup.tokenizer.chat_template == TEMPLATE
    assert setup.spec.vocab_size == len(reference)
    # The model's end of turn stops a response as well as the tokenizer's EOS.
    assert setup.stop_token_ids == (reference.eos_token_id, reference.convert_tokens_to_ids("<|eot|>"))


def test_tokenizer_problems_name_the_flag_and_directory(hf_dir, tmp_path):
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"--tokenizer '.*weights_only' \(by default the model's directory\): no "
                                         r"tokenizer files"):
        load_tokenizer(parse_args(["--load-hf", str(weights_only)]))
    with pytest.raises(ValueError, match=r"--tokenizer '/no/such/dir': no such directory"):
        load_tokenizer(parse_args(["--load-hf", str(weights_only), "--tokenizer", "/no/such/dir"]))
    assert load_tokenizer(parse_args(["--load-hf", str(weights_only), "--tokenizer", hf_dir])).chat_template
    plain = _save_tokenizer(tmp_path / "plain", chat_template=None)
    assert load_tokenizer(parse_args(["--tokenizer", plain])).chat_template is None
    with pytest.raises(ValueError, match=r"--apply-chat-template: the tokenizer in '.*plain' has no chat template"):
        load_tokenizer(parse_args(["--tokenizer", plain, "--apply-chat-template"]))


@pytest.mark.parametrize("config,expected", [
    ({"eos_token_id": 5}, (2, 5)),
    ({"eos_token_id": [2, 7, 9]}, (2, 7, 9)),
    ({"bos_token_id": 1}, (2,)),
    (None, (2,)),
])
def test_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path, config, expected):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert stop_token_ids(build_char_tokenizer(), [None, str(tmp_path)]) == expected


def test_a_bad_generation_config_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<eos>"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: field 'eos_token_id' must be an integer or a "
                                         r"list of integers, got \['<eos>'\]"):
        stop_token_ids(build_char_tokenizer(), [str(tmp_path)])


def _megatron_padded_vocab(vocab_size, divisible_by, tp):
    """Megatron-LM's `_vocab_size_with_padding`, as it is written there."""
    after, multiple = vocab_size, divisible_by * tp
    while after % multiple != 0:
        after += 1
    return after


@pytest.mark.parametrize("model,tp,divisible_by", [("tiny-llama", 2, 64), ("tiny-arith", 1, 128),
                                                   ("tiny-qwen2", 2, 8)])
def test_a_model_from_scratch_takes_the_tokenizers_vocabulary_padded_as_megatron_pads(tmp_path, model, tp,
                                                                                       divisible_by):
    from megatron_rl.models.weight_map import megatron_shards

    # More tokens than the named tiny specs' 128: the tokenizer decides the vocabulary, not the spec.
    directory = _save_tokenizer(tmp_path / "tok", words=[f"word{i}" for i in range(70)])
    setup = build_run_setup(parse_args(["--model", model, "--tokenizer", directory, "--tensor-model-parallel-size",
                                        str(tp), "--make-vocab-size-divisible-by", str(divisible_by)]), tp + 1)
    assert setup.spec.vocab_size == len(setup.tokenizer) > get_model_spec("tiny-llama").vocab_size
    embedding = megatron_shards(setup.spec, setup.trainer, 0, 0)["embedding.word_embeddings.weight"]
    assert embedding.shape[0] * tp == _megatron_padded_vocab(len(setup.tokenizer), divisible_by, tp)


def test_the_reward_stage_drops_every_stop_token(hf_dir):
    from megatron_rl.controller.reward_stage import RewardStage
    from megatron_rl.rollout.types import RequestMeta, RolloutOutput

    tok = load_tokenizer(parse_args(["--tokenizer", hf_dir]))
    stops = (tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>"))
    ids = tok.encode("x=4", add_special_tokens=False)
    messages = queue.Queue()
    messages.put((("rollouts", ([(RolloutOutput("p#0", [1], ids + [stops[1]], [0.0] * 4, [0] * 4, "stop"),
                                  RequestMeta("p", 0, "4", False, 0.0))], {})), 1))
    messages.put((("stopped", {}), 1))
    seen = []

    def reward_fn(samples):
        seen.extend(s.response for s in samples)
        return [None] * len(samples)

    class Channel:
        def recv(self):
            return messages.get(timeout=30)

    stage = RewardStage(Channel(), tok, reward_fn, 1, stops)
    stage.get(30)
    assert seen == [tok.decode(ids)] == ["x=4"]


def test_the_controller_sends_templated_prompts_with_every_stop_token(hf_dir, tmp_path):
    from megatron_rl.controller.loop import Controller

    records = [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)} for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = parse_args(["--load-hf", hf_dir, "--prompt-data", str(data), "--apply-chat-template", "--system-prompt",
                       "Be brief.", "--global-batch-size", "8", "--micro-batch-size", "8",
                       "--n-samples-per-prompt", "4", "--output-dir", str(tmp_path / "out"),
                       "--custom-rm-path", "json:dumps", "--reward-num-workers", "1"])
    setup = build_run_setup(args, 2)
    sent = []

    class Control:
        last_sent = 0.0  # read by the controller's keep-alive

        def send(self, message, rank):
            sent.append(message)

    class Rollouts:
        def recv(self):
            return ("stopped", {}), 1

    controller = Controller(setup, None, Control(), Rollouts(), [1])
    controller.top_up(2)
    requests = [r for kind, batch in sent if kind == "requests" for r in batch]
    assert len(requests) == 8
    by_answer = {r["answer"]: r["prompt"] for r in records}
    for _rid, prompt_ids, params, meta in requests:
        chat = [{"role": "system", "content": "Be brief."}, *by_answer[meta.reference]]
        assert prompt_ids == setup.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        assert params["stop_token_ids"] == setup.stop_token_ids and len(setup.stop_token_ids) == 2
    controller.logger.close()
    controller.reward_fn.close()


def test_sft_data_imitates_each_conversations_last_assistant_message(tmp_path):
    from megatron_rl.controller.prompt_source import PromptSource

    chats = [[{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"\\boxed{{{i + 1}}}"}]
             for i in range(3)]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": c, "answer": c[-1]["content"]}) + "\n" for c in chats))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": chats[0][:1], "answer": "1"}) + "\n")
    flags = ["--prompt-data", str(prompts), "--input-key", "messages", "--apply-chat-template", "--tokenizer", "x",
             "--sft-warmup-iters", "1"]
    source = PromptSource(parse_args([*flags, "--sft-data", str(sft)]))
    examples = source.sft(3)
    assert sorted((e["prompt"][0]["content"], e["answer"]) for e in examples) == \
        [(c[0]["content"], c[1]["content"]) for c in chats]
    assert all(len(e["prompt"]) == 1 for e in examples)  # the assistant's message is the target, not the prompt
    sft.write_text(json.dumps({"messages": chats[0][:1], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"--sft-data .*: record 0 \(line or row 1\) must be a message list ending "
                                         r"with an assistant message"):
        PromptSource(parse_args([*flags, "--sft-data", str(sft)]))


def test_prompts_too_long_for_seq_length_fail_at_start_naming_the_record_and_flags():
    from megatron_rl.data.prompts import check_prompt_lengths

    tok = build_char_tokenizer()
    records = [{"id": "a", "prompt": "1+1="}, {"id": "b", "prompt": "12345+67890="}]
    encode = lambda p: encode_prompt(tok, p, False)  # noqa: E731 - BOS + one token per character
    check_prompt_lengths(records, encode, 13, "--prompt-data d.jsonl", "--rollout-max-response-len")
    with pytest.raises(ValueError, match=r"--prompt-data d.jsonl: record 'b' has a prompt of 13 tokens, more than the "
                                         r"12 that --seq-length leaves after --rollout-max-response-len"):
        check_prompt_lengths(records, encode, 12, "--prompt-data d.jsonl", "--rollout-max-response-len")


def test_the_word_problem_dataset_is_chat_shaped_disjoint_and_its_tokenizer_renders_the_template(tmp_path):
    from fractions import Fraction

    from transformers import AutoTokenizer

    from megatron_rl.data.tasks.word_problems import write

    write(str(tmp_path), train=300, eval_size=40, seed=0)
    rows = {s: [json.loads(line) for line in open(tmp_path / f"{s}.jsonl")] for s in ("train", "eval")}
    questions = {s: [r["messages"][0]["content"] for r in rows[s]] for s in rows}
    assert len(set(questions["train"])) == 300 and len(set(questions["eval"])) == 40  # distinct
    assert not set(questions["train"]) & set(questions["eval"])  # held out
    for r in rows["train"] + rows["eval"]:
        answer = r["answer"].replace("\\frac{", "").replace("}{", "/").rstrip("}")
        assert Fraction(answer) > 0 and r["messages"][0]["role"] == "user"
    tok = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    chat = [{"role": "user", "content": questions["eval"][0]}]
    ids = encode_prompt(tok, chat, True, "Solve it.")
    assert tok.decode(ids) == f"<|system|>Solve it.<|end|><|user|>{questions['eval'][0]}<|end|><|assistant|>"
    assert tok.eos_token == "<|end|>" and tok.decode(tok.encode("\\boxed{\\frac{3}{4}}")) == "\\boxed{\\frac{3}{4}}"
