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
