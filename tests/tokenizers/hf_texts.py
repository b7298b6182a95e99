"""The texts the Hugging Face and GGUF tokenizers are compared with their oracles on: spaces,
runs of spaces, newlines, tabs, digit runs, non-ASCII, emoji and special tokens."""

TEXTS = [
    "Hello world",
    "  two  spaces   three    ",
    "line\nnext\n\n\nx\r\n",
    "tab\there\t\t end",
    "digits 1234567 and 3.14159, 2024-01-02",
    "café naïve Ελληνικά 日本語 Ünïcödé",
    "emoji 🙂🚀 👩\u200d👩\u200d👧 done",
    "it's I'M we'll THEY'D",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]
