"""Write the real-model benchmark's prompts and calibration set (chat-formatted for SmolLM2-Instruct).

The texts are written for this project (not cut from public sources), so the model cannot have seen
them. Half are code tasks, half prose; most give the model material to work from (edit this function,
summarise this note), which is how an assistant is used and where lookup drafts have something to find.
Run: python benchmarks/data/make_prompts.py  (rewrites the two .jsonl files next to it)
"""

import json
from pathlib import Path

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat(user: str) -> str:
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [
    "Add type hints and a docstring to this function:\n\n```python\ndef merge_counts(first, second):\n"
    "    result = dict(first)\n    for key, value in second.items():\n        result[key] = result.get(key, 0) + value\n"
    "    return result\n```",
    "Rewrite this loop as a list comprehension and explain the change:\n\n```python\nsquares = []\n"
    "for number in numbers:\n    if number % 2 == 0:\n        squares.append(number * number)\n```",
    "Fix the bug in this function; it should return the largest value in the list:\n\n```python\n"
    "def largest(values):\n    best = 0\n    for value in values:\n        if value < best:\n            best = value\n"
    "    return best\n```",
    "Convert this JavaScript function to Python:\n\n```javascript\nfunction countWords(text) {\n"
    "  const counts = {};\n  for (const word of text.split(' ')) {\n    counts[word] = (counts[word] || 0) + 1;\n  }\n"
    "  return counts;\n}\n```",
    "Write a Python class `Inventory` with methods `add_item(name, quantity)`, `remove_item(name, quantity)` "
    "and `total_items()`. Use a dictionary to store the items.",
    "Explain what this SQL query returns:\n\n```sql\nSELECT customer_id, COUNT(*) AS orders\nFROM orders\n"
    "WHERE order_date >= '2024-01-01'\nGROUP BY customer_id\nHAVING COUNT(*) > 3\nORDER BY orders DESC;\n```",
    "Summarize this note in three sentences:\n\nThe garden committee met on Tuesday to plan the spring planting. "
    "Maria will order tomato and pepper seedlings from the nursery on Oak Street. Daniel offered to repair the "
    "broken water barrel before the end of March. The committee agreed to move the compost bins closer to the "
    "gate so that neighbours can reach them more easily. The next meeting is on the first Tuesday of April.",
    "Rewrite this paragraph in a more formal tone:\n\nHey team, quick heads up: the printer on the second floor "
    "is broken again, so please use the one by the kitchen for now. Someone from IT is coming Thursday to fix it. "
    "Also, don't forget to clean out the fridge before Friday!",
    "Read the text and answer the question.\n\nText: The lighthouse on Carrow Point was built in 1871 and stood "
    "for almost a century before it was replaced by an automatic beacon. Its last keeper, Thomas Reed, lived "
    "there with his wife and three children and kept a daily log of passing ships.\n\nQuestion: Who was the last "
    "keeper of the lighthouse, and what did he record?",
    "Turn this list into a short friendly email inviting colleagues to a lunch:\n\n- date: Friday 14 June\n"
    "- place: the Blue Door cafe\n- time: 12:30\n- reason: to welcome Priya to the team\n- reply by Wednesday",
    "Write a short story of about one hundred words about a cat who learns to open the kitchen door.",
    "List five practical tips for studying effectively for an exam, with one sentence explaining each tip.",
]

CALIBRATION = [
    "Add error handling to this function:\n\n```python\ndef read_number(path):\n    with open(path) as handle:\n"
    "        return int(handle.read())\n```",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what this function does:\n\n```python\ndef flatten(items):\n    out = []\n    for item in items:\n"
    "        out.extend(item)\n    return out\n```",
    "Rename the variables in this code to make it clearer:\n\n```python\ndef f(a, b):\n    c = a * b\n"
    "    d = c / 2\n    return d\n```",
    "Summarize this message in two sentences:\n\nThe library will close early on Thursday because of the staff "
    "training day. Books that are due on Thursday can be returned on Friday without a fine. The reading room "
    "will reopen at nine on Friday morning.",
    "Rewrite this sentence so it is easier to read: The results of the survey, which was sent to all members "
    "in May and returned by most of them before the deadline, show a clear preference for evening meetings.",
    "Write a short poem about the sea in the morning.",
    "Give three reasons why regular exercise is good for health.",
]

if __name__ == "__main__":
    here = Path(__file__).parent
    for name, texts in (("smollm2_prompts.jsonl", PROMPTS), ("smollm2_calibration.jsonl", CALIBRATION)):
        with open(here / name, "w") as handle:
            for text in texts:
                handle.write(json.dumps({"prompt": chat(text)}) + "\n")
        print(f"wrote {len(texts)} prompts to {here / name}")
