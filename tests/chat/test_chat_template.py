"""Chat templates render to the ids transformers' apply_chat_template gives."""

import pytest
import tiny_chat

from decoderlm.io.hf import hf_tokenizer
from decoderlm.tokenizers.chat_template import ChatTemplate, ChatTemplateError, chat_template_of

from conftest import SMOLLM2_GGUF, needs_smollm2

transformers = pytest.importorskip("transformers")

chat_dir = tiny_chat.chat_dir  # the fixture

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "The capital of France?"},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello, how are you?"},
        {"role": "user", "content": "Fine, thank you. <html> & Ünïcödé"},
    ],
]
# special tokens as variables, tojson without HTML escapes, loop controls, raise_exception
FANCY = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user or assistant, not ' + m['role']) }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}{{ eos_token }}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def both(chat_dir):
    directory, _ = chat_dir
    ours = hf_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    return ours, theirs


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_models_template_gives_transformers_ids(both, conversation, generation_prompt):
    ours, theirs = both
    template = chat_template_of(ours)
    want = theirs.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    assert template.encode(conversation, generation_prompt) == list(want)


def test_the_end_of_turn_token_is_the_one_after_an_assistant_message(both):
    ours, _ = both
    template = chat_template_of(ours)
    im_end = ours.special_tokens["<|im_end|>"]
    assert template.end_ids == (ours.eot_token, im_end) and ours.eot_token == 0


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_special_tokens_tojson_and_loop_controls_as_transformers(both, conversation):
    ours, theirs = both
    chat = [*conversation, {"role": "tool", "content": "skipped"}]
    want = theirs.apply_chat_template(
        chat, chat_template=FANCY, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ChatTemplate(FANCY, ours).encode(chat) == list(want)
    text = ChatTemplate(FANCY, ours).render(chat)
    assert '"Fine, thank you. <html> & Ünïcödé"' in text or "Fine" not in text


def test_a_template_that_raises_names_its_message_as_transformers_does(both):
    ours, theirs = both
    chat = [{"role": "robot", "content": "beep"}]
    with pytest.raises(Exception, match="not robot"):
        theirs.apply_chat_template(chat, chat_template=FANCY, tokenize=True)
    with pytest.raises(ChatTemplateError, match="chat template failed: roles are .* not robot"):
        ChatTemplate(FANCY, ours).encode(chat)


def test_a_template_that_does_not_compile_is_one_line(both):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", both[0])


def test_a_template_file_wins_and_no_template_is_none(both, tmp_path):
    from decoderlm.tokenizers import GPT2Tokenizer

    assert chat_template_of(GPT2Tokenizer()) is None
    path = tmp_path / "t.jinja"
    path.write_text(FANCY)
    assert chat_template_of(both[0], str(path)).source == FANCY


@needs_smollm2
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm2_gguf_template_gives_transformers_ids(conversation):
    from decoderlm.io.gguf import load_gguf_tokenizer

    ours = load_gguf_tokenizer(SMOLLM2_GGUF)
    theirs = transformers.AutoTokenizer.from_pretrained(
        SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name
    )
    template = chat_template_of(ours)
    want = theirs.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert template.encode(conversation) == list(want)
    assert ours.special_tokens["<|im_end|>"] in template.end_ids
