#!/usr/bin/env python3
"""Draws the bundled demo episode (models/demo/episode/): a 12-step cross-app phone task whose
screenshots are synthetic (flat UI drawn with PIL) and whose responses follow the GUI-Owl-1.5 mobile
format. `recall demo` replays it on the tiny model; the screens only need to look like screens.

    .venv-tools/bin/python tools/gen_demo_episode.py
"""

import json
import os
import shutil

from PIL import Image, ImageDraw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "models", "demo", "episode")
W, H = 180, 320

INSTRUCTION = "Check the weather in Paris in the Weather app, then send the forecast to Alice in Messages."


def screen(title, color, rows=(), highlight=None, keyboard=False, banner=None):
    img = Image.new("RGB", (W, H), (246, 246, 248))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, W, 14], fill=(30, 30, 30))
    d.text((4, 2), "9:41", fill=(255, 255, 255))
    if title:
        d.rectangle([0, 14, W, 44], fill=color)
        d.text((8, 22), title, fill=(255, 255, 255))
    y = 54
    for i, row in enumerate(rows):
        fill = (255, 236, 179) if highlight == i else (255, 255, 255)
        d.rectangle([8, y, W - 8, y + 28], fill=fill, outline=(200, 200, 205))
        d.text((14, y + 9), row, fill=(20, 20, 20))
        y += 34
    if banner:
        d.rectangle([8, y + 6, W - 8, y + 70], fill=color)
        d.text((16, y + 28), banner, fill=(255, 255, 255))
    if keyboard:
        d.rectangle([0, H - 110, W, H], fill=(210, 212, 218))
        for r in range(4):
            for c in range(9):
                x0, y0 = 4 + c * 19, H - 104 + r * 26
                d.rectangle([x0, y0, x0 + 16, y0 + 22], fill=(255, 255, 255))
    return img


def home(highlight=None):
    img = Image.new("RGB", (W, H), (52, 88, 140))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, W, 14], fill=(20, 40, 70))
    apps = [("Weather", (250, 180, 40)), ("Messages", (60, 200, 90)), ("Maps", (220, 70, 70)),
            ("Camera", (120, 120, 130)), ("Mail", (70, 140, 230)), ("Clock", (40, 40, 40))]
    for i, (name, c) in enumerate(apps):
        x0, y0 = 14 + (i % 3) * 56, 40 + (i // 3) * 70
        d.rounded_rectangle([x0, y0, x0 + 40, y0 + 40], 8, fill=c, outline=(255, 255, 255) if highlight == name else None)
        d.text((x0, y0 + 44), name, fill=(255, 255, 255))
    return img


def response(line, args):
    call = json.dumps({"name": "mobile_use", "arguments": args})
    return f"Action: {line}\n<tool_call>\n{call}\n</tool_call>"


STEPS = [
    (home("Weather"), "Open the Weather app.", {"action": "open", "text": "Weather"}),
    (screen("Weather", (250, 160, 30), ["Berlin  12C cloudy", "Search city"], banner="Berlin 12C"),
     "Tap the search field.", {"action": "click", "coordinate": [500, 285]}),
    (screen("Weather", (250, 160, 30), ["Search city|"], keyboard=True),
     "Type Paris into the search field.", {"action": "type", "text": "Paris"}),
    (screen("Weather", (250, 160, 30), ["Paris, France", "Paris, Texas", "Parisot"], highlight=0),
     "Select Paris, France.", {"action": "click", "coordinate": [500, 215]}),
    (screen("Paris", (250, 160, 30), ["Today  18C sunny", "Tomorrow  16C rain"], banner="Paris 18C sunny"),
     "Go back to the home screen.", {"action": "system_button", "button": "Home"}),
    (home("Messages"), "Open the Messages app.", {"action": "open", "text": "Messages"}),
    (screen("Messages", (60, 180, 90), ["Alice", "Bob", "Carol"], highlight=0),
     "Open the conversation with Alice.", {"action": "click", "coordinate": [500, 215]}),
    (screen("Alice", (60, 180, 90), ["Alice: lunch tomorrow?", "Message..."]),
     "Tap the message box.", {"action": "click", "coordinate": [500, 285]}),
    (screen("Alice", (60, 180, 90), ["Alice: lunch tomorrow?", "Message...|"], keyboard=True),
     "Type the forecast.", {"action": "type", "text": "Paris today: 18C and sunny"}),
    (screen("Alice", (60, 180, 90), ["Alice: lunch tomorrow?", "Paris today: 18C and sunny"], keyboard=True),
     "Tap send.", {"action": "click", "coordinate": [930, 285]}),
    (screen("Alice", (60, 180, 90), ["Alice: lunch tomorrow?", "You: Paris today: 18C and sunny"]),
     "Check that the message was delivered.", {"action": "wait", "time": 1}),
    (screen("Alice", (60, 180, 90), ["Alice: lunch tomorrow?", "You: Paris today: 18C and sunny", "Delivered"]),
     "The forecast was sent.", {"action": "terminate", "status": "success"}),
]


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    steps = []
    for i, (img, line, args) in enumerate(STEPS, start=1):
        name = f"step{i:02d}.png"
        img.save(os.path.join(OUT, name))
        steps.append({"screenshot": name, "response": response(line, args)})
    final = screen("Alice", (60, 180, 90), ["You: Paris today: 18C and sunny", "Delivered", "Alice: thanks!"])
    final.save(os.path.join(OUT, "final.png"))
    with open(os.path.join(OUT, "episode.json"), "w") as f:
        json.dump({"instruction": INSTRUCTION, "platform": "mobile", "steps": steps,
                   "final_screenshot": "final.png"}, f, indent=2, ensure_ascii=False)
    print(f"{OUT}: {len(steps)} steps")


if __name__ == "__main__":
    main()
