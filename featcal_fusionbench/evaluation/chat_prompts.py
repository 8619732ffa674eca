"""Chat prompts that end inside the assistant's reply, rendered as EvalPlus renders them.

lm-eval 0.4.13 renders a task's ``gen_prefix`` as the assistant's message continued (``continue_final_message``). A
template that trims each message (Llama 3's ``message['content'] | trim``) then drops the prefix's final line break:
EvalPlus's chat prompt ends "```python\\n", lm-eval's "```python". EvalPlus (evalplus/provider/utility.py,
``make_raw_chat_prompt``, evalplus 0.3.1) renders the assistant's message closed, with a splitter after the
opened code block, and keeps what comes before the splitter; the tasks named here are rendered the same way.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

#: EvalPlus's ``_MAGIC_SPLITTER_`` (evalplus/provider/utility.py)
SPLITTER = "-[[]]-this-is-really-our-highest-priority-[[]]-"
#: what EvalPlus's assistant message holds after the splitter (its ``response``: the code block closed)
CLOSING = "\n```\n"
#: our task files whose gen_prefix is rendered as EvalPlus renders its response prefix
EVALPLUS_CHAT_TASKS = frozenset({"evalplus_humaneval_chat", "evalplus_mbpp_chat"})


def render_open_reply(tokenizer, chat_history: List[Mapping[str, str]], **template_args: Any) -> str:
    """The chat whose last message is the assistant's opened reply, rendered up to the end of that reply: the
    message closed (``SPLITTER`` and ``CLOSING`` after it), the chat rendered whole, cut at the splitter."""
    if not chat_history or chat_history[-1]["role"] != "assistant":
        raise ValueError("an opened reply is the chat's last message, the assistant's")
    last = dict(chat_history[-1])
    last["content"] = last["content"] + SPLITTER + CLOSING
    rendered = tokenizer.apply_chat_template([*chat_history[:-1], last], tokenize=False, **template_args)
    head, found, _ = rendered.partition(SPLITTER)
    if not found:
        raise ValueError("the chat template dropped the assistant's message: its opened reply cannot be rendered")
    return head


def language_model(model, tokenizer, batch_size) -> Any:
    """lm-eval's HF model over ``model``, whose ``reply_as_evalplus`` (set per task) renders a task's gen_prefix
    with ``render_open_reply``; every other chat as lm-eval renders it."""
    from lm_eval.models.huggingface import HFLM

    class ChatHFLM(HFLM):
        reply_as_evalplus = False

        def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
            if self.reply_as_evalplus and not add_generation_prompt:
                return render_open_reply(self.tokenizer, chat_history, **self.chat_template_args)
            return super().apply_chat_template(chat_history, add_generation_prompt)

    return ChatHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
