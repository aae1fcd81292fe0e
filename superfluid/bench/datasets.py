"""Benchmark datasets, generated locally from a seed (nothing is downloaded).

Each dataset is a list of ``BenchRequest``s; the same (name, n, seed, output_len)
always gives the same requests, so two servers measured side by side see the same load.

    chat                   varied prompt lengths (~16-512 tokens) and output lengths
    shared-prefix          one long (~1,000-token) system prompt shared by every request,
                           then a short question: what a prefix cache pays for
    shared-prefix-nocache  the same, with a random nonce at the start of each system
                           prompt so no two requests share more than the template header
    grounded               summarise or edit a given text or code: the answer copies from
                           the prompt, which is what prompt-lookup speculation pays for
    json                   extract fields from a text into JSON, via response_format
                           (json_schema); outputs end when the object does (no ignore_eos)
    long                   a ~2,000-token document of its own per request, then a question
                           (prefill-bound; no shared prefix)
    multi-turn             chat sessions of several turns; each turn resends the whole history.
                           The load generator sends a session's turns one after another with
                           the server's real answers in it (a listing shows stand-in prose)

Token counts are estimates (English prose from a common-word vocabulary runs ~1.3
tokens a word in GPT-2-style BPE); the serving results report the real counts from usage.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace

TOKENS_PER_WORD = 1.3

# ------------------------------------------------------------------ vocabulary

_NOUNS = (
    "system server client request response cache memory model token batch queue thread "
    "process network packet schedule budget report customer order invoice account policy "
    "garden river mountain city village library museum teacher student doctor engineer "
    "farmer artist window door table chair kitchen market bridge road train station "
    "harbor ship island forest meadow storm season harvest festival letter journal "
    "record archive sensor signal device battery engine pump valve pipeline factory"
).split()
_ADJS = (
    "quick careful quiet bright heavy light early late small large modern ancient "
    "simple complex reliable fragile local remote shared private busy empty green "
    "northern southern narrow wide steady sudden rare common useful formal"
).split()
_VERBS = (
    "checks builds moves keeps sends reads writes opens closes follows watches repairs "
    "collects measures records explains describes protects improves replaces carries "
    "updates reviews prepares delivers answers"
).split()
_ADVS = "slowly quickly carefully rarely often always never usually quietly openly".split()
_PREPS = "near behind under over beside across through along after before".split()
_FIRST = "Alice Bruno Chen Dana Emil Farah Goran Hana Ivan Jules Kenji Lena Mateo Nora Omar Priya".split()
_LAST = "Novak Silva Tanaka Okafor Berg Costa Ivanova Laurent Moreau Haddad Kowalski Lindqvist".split()
_CITIES = "Lisbon Oslo Nairobi Kyoto Lima Tallinn Porto Quebec Seville Hobart Tromso Valparaiso".split()
_SKILLS = "welding accounting python carpentry translation nursing surveying baking sailing statistics".split()
_TOPICS = (
    "the history of bridges", "how tides work", "planning a small garden", "why bread rises",
    "the rules of chess", "how a compiler works", "saving energy at home", "the water cycle",
    "learning a new language", "how vaccines work", "the life of bees", "writing a good report",
    "choosing a bicycle", "how batteries store energy", "caring for houseplants", "the night sky",
)
_CHAT_ASKS = (
    "Explain {t} to a curious teenager.", "Write a short story about {t}.",
    "Give me five tips about {t}.", "What are common mistakes people make about {t}?",
    "Summarise what you know about {t} in a few paragraphs.", "Write a poem about {t}.",
)


def _sentence(rng: random.Random) -> str:
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    forms = (
        f"The {rng.choice(_ADJS)} {n1} {rng.choice(_VERBS)} the {n2} {rng.choice(_ADVS)}.",
        f"Every {n1} {rng.choice(_VERBS)} a {rng.choice(_ADJS)} {n2} {rng.choice(_PREPS)} the {rng.choice(_NOUNS)}.",
        f"A {rng.choice(_ADJS)} {n1} {rng.choice(_ADVS)} {rng.choice(_VERBS)} the {n2}.",
        f"{rng.choice(_FIRST)} {rng.choice(_VERBS)} the {n1} {rng.choice(_PREPS)} the {rng.choice(_ADJS)} {n2}.",
    )
    return rng.choice(forms)


def prose(rng: random.Random, approx_tokens: int) -> str:
    """English-looking paragraphs of about ``approx_tokens`` tokens."""
    words_wanted = max(4, int(approx_tokens / TOKENS_PER_WORD))
    paragraphs, para, words = [], [], 0
    while words < words_wanted:
        s = _sentence(rng)
        para.append(s)
        words += len(s.split())
        if len(para) >= rng.randint(3, 6):
            paragraphs.append(" ".join(para))
            para = []
    if para:
        paragraphs.append(" ".join(para))
    return "\n\n".join(paragraphs)


def code(rng: random.Random, approx_tokens: int) -> str:
    """Plain Python functions of about ``approx_tokens`` tokens (code runs ~0.3 tokens/char)."""
    funcs, chars = [], 0
    while chars * 0.3 < approx_tokens:
        name = f"{rng.choice(_VERBS).rstrip('s')}_{rng.choice(_NOUNS)}"
        a, b = rng.sample(("items", "limit", "total", "count", "values", "scale", "offset", "names"), 2)
        op = rng.choice(("+", "-", "*"))
        k = rng.randint(2, 9)
        body = (
            f"def {name}({a}, {b}):\n"
            f"    \"\"\"Return the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} for {a} and {b}.\"\"\"\n"
            f"    result = []\n"
            f"    for i, x in enumerate({a}):\n"
            f"        if i % {k} == 0:\n"
            f"            result.append(x {op} {b})\n"
            f"        else:\n"
            f"            result.append(x)\n"
            f"    return result\n"
        )
        funcs.append(body)
        chars += len(body)
    return "\n\n".join(funcs)


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class BenchRequest:
    """One request of a dataset, in chat form (``prompt_text`` gives the completions form)."""

    messages: tuple[dict, ...]
    max_tokens: int
    response_format: dict | None = None
    ignore_eos_ok: bool = True  # False where the output must end by itself (JSON)
    source: str | None = None  # grounded / json: the text the answer draws on
    kind: str = "chat"
    meta: dict = field(default_factory=dict)

    def prompt_text(self) -> str:
        """The messages as one plain prompt, for /v1/completions."""
        parts = [f"{m['role']}: {m['content']}" for m in self.messages]
        return "\n\n".join(parts) + "\n\nassistant:"

    def with_answers(self, answers: list[str]) -> "BenchRequest":
        """This request with its first assistant turns replaced by ``answers``: a multi-turn
        session resends what the server actually answered, as a chat client does."""
        it = iter(answers)
        msgs = tuple(dict(m, content=next(it, m["content"])) if m["role"] == "assistant" else m
                     for m in self.messages)
        return replace(self, messages=msgs)

    def body(self, model: str, endpoint: str = "chat", ignore_eos: bool = False, temperature: float = 0.0,
             extra: dict | None = None) -> dict:
        """The OpenAI request body (streaming, with usage in the last chunk)."""
        body: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if endpoint == "chat":
            body["messages"] = [dict(m) for m in self.messages]
        else:
            body["prompt"] = self.prompt_text()
        if self.response_format is not None:
            body["response_format"] = self.response_format
        if ignore_eos and self.ignore_eos_ok:
            body["ignore_eos"] = True
        if extra:
            body.update(extra)
        return body


def _chat(rng: random.Random, n: int, output_len: int) -> list[BenchRequest]:
    out = []
    lo = min(output_len, max(8, output_len // 4))
    for _ in range(n):
        # log-uniform prompt length: mostly short questions, some long contexts
        ptoks = int(round(2 ** rng.uniform(4, 9)))
        ask = rng.choice(_CHAT_ASKS).format(t=rng.choice(_TOPICS))
        context = prose(rng, max(0, ptoks - 12)) if ptoks > 24 else ""
        content = f"{context}\n\n{ask}" if context else ask
        out.append(BenchRequest(messages=({"role": "user", "content": content},),
                                max_tokens=rng.randint(lo, output_len), kind="chat",
                                meta={"approx_prompt_tokens": ptoks}))
    return out


def shared_system_prompt(seed: int, approx_tokens: int = 1000) -> str:
    rng = random.Random(f"system-{seed}")
    head = ("You are the assistant of the Northwind operations desk. Follow the handbook below "
            "exactly. Answer briefly and cite the section you used.\n\n")
    body = []
    for i, chunk in enumerate(prose(rng, approx_tokens - 40).split("\n\n")):
        body.append(f"Section {i + 1}. {chunk}")
    return head + "\n\n".join(body)


def _shared_prefix(rng: random.Random, n: int, output_len: int, seed: int, nonce: bool) -> list[BenchRequest]:
    system = shared_system_prompt(seed)
    out = []
    for _ in range(n):
        q = (f"Which section covers the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}, and what does it say "
             f"about {rng.choice(_TOPICS)}?")
        sys_text = system
        if nonce:
            # at the very start of the system prompt: defeats any prefix cache past the template header
            sys_text = f"[session {rng.getrandbits(64):016x}] " + system
        out.append(BenchRequest(messages=({"role": "system", "content": sys_text}, {"role": "user", "content": q}),
                                max_tokens=output_len, kind="shared-prefix-nocache" if nonce else "shared-prefix",
                                meta={"system_prompt_chars": len(sys_text)}))
    return out


_SUMMARY_ASKS = (
    "Summarise the following text in a few sentences, reusing its wording.",
    "Rewrite the following text exactly, but change every occurrence of \"{a}\" to \"{b}\".",
    "Copy the following text, fixing any grammar mistakes, and keep everything else unchanged.",
)
_CODE_ASKS = (
    "Rename the variable `result` to `output` in the following code and return the whole code.",
    "Add a type hint `list` to every parameter of the following functions and return the whole code.",
    "Return the following code unchanged except that every docstring is removed.",
)


def _grounded(rng: random.Random, n: int, output_len: int) -> list[BenchRequest]:
    out = []
    for i in range(n):
        is_code = i % 2 == 1
        size = rng.randint(max(64, output_len), max(96, 2 * output_len))
        if is_code:
            source = code(rng, size)
            ask = rng.choice(_CODE_ASKS)
            content = f"{ask}\n\n```python\n{source}\n```"
        else:
            source = prose(rng, size)
            a, b = rng.sample(_NOUNS, 2)
            ask = rng.choice(_SUMMARY_ASKS).format(a=a, b=b)
            content = f"{ask}\n\n\"\"\"\n{source}\n\"\"\""
        out.append(BenchRequest(messages=({"role": "user", "content": content},), max_tokens=output_len,
                                source=source, kind="grounded-code" if is_code else "grounded-text"))
    return out


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}


def _json(rng: random.Random, n: int, output_len: int) -> list[BenchRequest]:
    out = []
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    for _ in range(n):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        age, city = rng.randint(19, 80), rng.choice(_CITIES)
        skills = rng.sample(_SKILLS, rng.randint(1, 3))
        filler = prose(rng, rng.randint(20, 120))
        source = (f"{filler}\n\n{name} is {age} years old and lives in {city}. "
                  f"They are known for {', '.join(skills)}.\n\n{prose(rng, 30)}")
        content = ("Extract the person described in this text as JSON with the fields name, age, city "
                   f"and skills.\n\n{source}")
        out.append(BenchRequest(messages=({"role": "user", "content": content},), max_tokens=output_len,
                                response_format=fmt, ignore_eos_ok=False, source=source, kind="json",
                                meta={"expected": {"name": name, "age": age, "city": city, "skills": skills}}))
    return out


# long prompts: dataset name -> approximate prompt tokens (SmolLM2's tokenizer); long-8k stays
# inside an 8,192-token context with its output
LONG = {"long": 2000, "long-4k": 4000, "long-8k": 7800}


def _long(rng: random.Random, n: int, output_len: int, kind: str = "long") -> list[BenchRequest]:
    """A document of its own per request (LONG[kind] tokens), then a question: prefill-bound."""
    out = []
    for _ in range(n):
        doc = prose(rng, round(LONG[kind] * 1.06))  # ~1.06 words a token with the SmolLM2 tokenizer
        ask = f"Using the document above, {rng.choice(_CHAT_ASKS).format(t=rng.choice(_TOPICS)).lower()}"
        out.append(BenchRequest(messages=({"role": "user", "content": f"{doc}\n\n{ask}"},), max_tokens=output_len,
                                kind=kind, meta={"approx_prompt_tokens": LONG[kind]}))
    return out


def _multi_turn(rng: random.Random, n: int, output_len: int, turns: int = 4) -> list[BenchRequest]:
    """Sessions of ``turns`` requests; request k of a session is its first k user turns with the
    assistant turns between them, so each request's prompt extends the previous one's."""
    out: list[BenchRequest] = []
    session = 0
    while len(out) < n:
        history: list[dict] = []
        for turn in range(turns):
            if len(out) == n:
                break
            ask = rng.choice(_CHAT_ASKS).format(t=rng.choice(_TOPICS))
            history.append({"role": "user", "content": ask})
            out.append(BenchRequest(messages=tuple(dict(m) for m in history), max_tokens=output_len,
                                    kind="multi-turn", meta={"session": session, "turn": turn}))
            # a stand-in answer of about output_len tokens; the load generator (bench/serve.py)
            # sends a session's turns one after another and puts the server's real answer here
            history.append({"role": "assistant", "content": prose(rng, output_len)})
        session += 1
    return out


DATASETS = ("chat", "shared-prefix", "shared-prefix-nocache", "grounded", "json", *LONG, "multi-turn")


def make_dataset(name: str, n: int, seed: int = 0, output_len: int = 128) -> list[BenchRequest]:
    """``n`` requests of dataset ``name``; the same arguments give the same requests."""
    rng = random.Random(f"{name}-{seed}")
    if name == "chat":
        return _chat(rng, n, output_len)
    if name == "shared-prefix":
        return _shared_prefix(rng, n, output_len, seed, nonce=False)
    if name == "shared-prefix-nocache":
        return _shared_prefix(rng, n, output_len, seed, nonce=True)
    if name == "grounded":
        return _grounded(rng, n, output_len)
    if name == "json":
        return _json(rng, n, output_len)
    if name in LONG:
        return _long(rng, n, output_len, name)
    if name == "multi-turn":
        return _multi_turn(rng, n, output_len)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def dump_jsonl(requests: list[BenchRequest]) -> str:
    return "\n".join(json.dumps({"kind": r.kind, "messages": list(r.messages), "max_tokens": r.max_tokens,
                                 "response_format": r.response_format}) for r in requests)
