"""Helpers the Python trainers share for recall's chats (OpenAI-style messages, images as paths)."""


def image_paths(messages: list) -> list:
    """The image paths of a chat, in order (`image_url` and `image` parts; a `file://` prefix dropped)."""
    paths = []
    for m in messages:
        if isinstance(m.get("content"), list):
            for p in m["content"]:
                if p.get("type") == "image_url":
                    paths.append(p["image_url"]["url"])
                elif p.get("type") == "image":
                    paths.append(p["image"])
    return [p[len("file://"):] if p.startswith("file://") else p for p in paths]


def expand_image_pads(text: str, image_processor, images: list) -> tuple[str, dict]:
    """The chat text with each `<|image_pad|>` expanded to its image's merged-token count, as the HF
    processor does, and the pixel inputs (`pixel_values`, `image_grid_thw`) of `images` (PIL images)."""
    if not images:
        return text, {}
    proc = image_processor(images=images, return_tensors="pt")
    grid = proc["image_grid_thw"]
    counts = iter((grid.prod(-1) // image_processor.merge_size ** 2).tolist())
    parts = text.split("<|image_pad|>")
    text = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
    return text, dict(pixel_values=proc["pixel_values"], image_grid_thw=grid)
