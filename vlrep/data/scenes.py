"""Procedural scenes: images of a few coloured shapes with every annotation vlrep's methods train on.

This module is pure numpy/PIL so it can be tested and inspected without TFDS; `synthetic_scenes.py` wraps
it in a TFDS builder. One call of `generate_scene(rng, ...)` returns one fully annotated example:

- an RGB image (the "main" style: shapes on textured, gradient backgrounds; or the "sketch" style used as an
  out-of-domain shift: outlined, hatched shapes on paper),
- 5 captions from a grammar naming objects, attributes, counts and spatial relations,
- a Localized-Narratives-style narration with per-word times and a mouse trace that hovers over each object
  while it is named,
- the objects' boxes, visible masks, shape/colour/size labels and a VOC-style `difficult` flag,
- VQA-style question/answer pairs and entailment statements (entailment / contradiction / neutral).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# Ten shapes that stay distinct at 32 px (no diamond, hexagon or pentagon: at low resolution they read as a square
# and circles).
SHAPES = ("circle", "square", "triangle", "star", "cross", "arrow", "crescent", "ring", "bar", "heart")
COLORS = {
  "red": (220, 40, 40),
  "green": (40, 180, 60),
  "blue": (40, 80, 220),
  "yellow": (235, 215, 40),
  "purple": (150, 60, 190),
  "orange": (245, 140, 30),
  "white": (245, 245, 245),
  "black": (25, 25, 25),
}
COLOR_NAMES = tuple(COLORS)
SIZES = ("small", "large")
STYLES = ("main", "sketch")
ENTAILMENT_LABELS = ("entailment", "contradiction", "neutral")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")
_SHAPE_SYNONYMS = {"square": ("square", "box"), "circle": ("circle", "disc"), "ring": ("ring", "donut")}
_PLURAL = {"cross": "crosses", "box": "boxes"}
_MATERIALS = ("wooden", "metal", "plastic", "glass", "paper")
# Geometry, as fractions of the image side: at 64 px a small shape's radius is 7.7-9.6 px and a large one's
# 12.8-16.6 px, so each covers several cells of a stride-2 stem's 32x32 grid; a shape about one cell wide is not
# learned from its labels at the runlocal budget (docs/data.md, synthetic_scenes).
RADIUS = {"small": (0.12, 0.15), "large": (0.2, 0.26)}
MAX_OBJECTS = 3
# Main-style background: a two-colour gradient (channel values drawn in `colour`) with pixel noise, no stripes or
# blotches: clutter of that kind costs a small supervised model most of what it can learn at this budget
# (tests/learnability.py measures the learnability that matters).
BACKGROUND = {"colour": (60, 200), "noise": 4}
# Probability that a noun phrase names its object's colour (sizes are named with probability 0.5, shapes always).
# Real captions name objects and only sometimes their attributes; colour, which random features already encode,
# named every time makes captioning heads spend their first hundreds of steps on it and hardly learn shapes.
COLOUR_MENTION = 0.25


def plural(word: str) -> str:
  return _PLURAL.get(word, word + "s")


def shape_words(shape: str) -> tuple[str, ...]:
  """Every word the captions and narrations use for `shape`: its synonyms and their plurals."""
  names = _SHAPE_SYNONYMS.get(shape, (shape,))
  return tuple(names) + tuple(plural(n) for n in names)


def _shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
  """Vertices of a polygonal shape (circle, ring and heart are drawn separately)."""

  def regular(n, start, radius=r):
    return [
      (cx + radius * math.cos(start + 2 * math.pi * k / n), cy + radius * math.sin(start + 2 * math.pi * k / n))
      for k in range(n)
    ]

  if shape == "square":
    return regular(4, angle + math.pi / 4, r * 1.05)
  if shape == "triangle":
    return regular(3, angle - math.pi / 2, r * 1.1)
  if shape == "star":
    outer = regular(5, angle - math.pi / 2, r * 1.1)
    inner = regular(5, angle - math.pi / 2 + math.pi / 5, r * 0.45)
    return [p for pair in zip(outer, inner, strict=True) for p in pair]
  if shape == "cross":
    w = r * 0.35
    base = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w)]
    return _rotated(base, cx, cy, angle)
  if shape == "arrow":
    base = [(-r, -0.22 * r), (0.15 * r, -0.22 * r), (0.15 * r, -0.65 * r), (r, 0), (0.15 * r, 0.65 * r)]
    base += [(0.15 * r, 0.22 * r), (-r, 0.22 * r)]
    return _rotated(base, cx, cy, angle)
  if shape == "bar":
    return _rotated([(-r, -0.3 * r), (r, -0.3 * r), (r, 0.3 * r), (-r, 0.3 * r)], cx, cy, angle)
  if shape == "crescent":
    # The part of a disc of radius r outside a disc of radius 0.8 r whose centre is 0.5 r to the right: the outer
    # arc between the two circles' intersections, then the inner arc back.
    ri, d = 0.8 * r, 0.5 * r
    ix = (r * r - ri * ri + d * d) / (2 * d)
    iy = math.sqrt(r * r - ix * ix)
    phi, psi = math.atan2(iy, ix), math.atan2(iy, ix - d)
    outer = [(r * math.cos(t), r * math.sin(t)) for t in np.linspace(phi, 2 * math.pi - phi, 24)]
    inner = [(d + ri * math.cos(t), ri * math.sin(t)) for t in np.linspace(2 * math.pi - psi, psi, 24)]
    return _rotated(outer + inner, cx, cy, angle)
  if shape == "heart":
    pts = []
    for k in range(40):
      t = 2 * math.pi * k / 40
      x = 16 * math.sin(t) ** 3
      y = -(13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t))
      pts.append((cx + x * r / 17, cy + y * r / 17))
    return pts
  raise ValueError(shape)


def _rotated(points, cx: float, cy: float, angle: float) -> list[tuple[float, float]]:
  c, s = math.cos(angle), math.sin(angle)
  return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in points]


def _draw_shape(draw: ImageDraw.ImageDraw, shape, cx, cy, r, angle, fill, outline=None, width=1):
  if shape == "circle":
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=outline, width=width)
  elif shape == "ring":
    draw.ellipse(
      [cx - r, cy - r, cx + r, cy + r],
      outline=fill if outline is None else outline,
      width=max(2, int(r * 0.4)) if outline is None else width,
    )
  else:
    pts = _shape_polygon(shape, cx, cy, r, angle)
    draw.polygon(pts, fill=fill, outline=outline, width=width)


def _background(rng: np.random.Generator, size: int, style: str) -> np.ndarray:
  # Drawn at half the canvas size and upsampled (the canvas is itself downsampled 2x at the end): a quarter of the
  # work of the costliest part of generating a scene.
  half = size // 2
  ramp = np.arange(half, dtype=np.float32) / half
  if style == "main":
    c0, c1 = rng.uniform(*BACKGROUND["colour"], size=(2, 3)).astype(np.float32)
    direction = rng.uniform(0, 2 * math.pi)
    t = (np.cos(direction) * ramp[None, :] + np.sin(direction) * ramp[:, None] + 1) / 2
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    img += rng.standard_normal(img.shape, dtype=np.float32) * BACKGROUND["noise"]
  else:  # sketch: off-white paper with grain
    paper = rng.uniform(225, 250)
    img = np.full((half, half, 3), paper, np.float32) + 6 * rng.standard_normal((half, half, 1), dtype=np.float32)
  img = np.clip(img, 0, 255).astype(np.uint8)
  return np.repeat(np.repeat(img, 2, axis=0), 2, axis=1)


def _relation(a: dict, b: dict) -> str:
  """Spatial relation of object a with respect to object b, in image coordinates (x to the right)."""
  dx, dy = a["cx"] - b["cx"], a["cy"] - b["cy"]
  if abs(dx) >= abs(dy):
    return "to the left of" if dx < 0 else "to the right of"
  return "above" if dy < 0 else "below"


def _where(obj: dict, size: int) -> str:
  x, y = obj["cx"] / size, obj["cy"] / size
  horiz = "on the left" if x < 0.4 else "on the right" if x > 0.6 else "in the middle"
  vert = "at the top" if y < 0.35 else "at the bottom" if y > 0.65 else ""
  return f"{vert} {horiz}".strip() if vert and horiz != "in the middle" else (vert or horiz)


def _np(obj: dict, rng: np.random.Generator, article=True, with_size=None) -> str:
  words = []
  if with_size if with_size is not None else rng.random() < 0.5:
    words.append(obj["size"])
  if rng.random() < COLOUR_MENTION:
    words.append(obj["color"])
  words.append(rng.choice(_SHAPE_SYNONYMS.get(obj["shape"], (obj["shape"],))))
  phrase = " ".join(words)
  if article:
    phrase = _article(phrase) + " " + phrase
  return phrase


def _article(phrase: str) -> str:
  return "an" if phrase[0] in "aeiou" else "a"


def _captions(objs: list[dict], rng: np.random.Generator, size: int, style: str) -> list[str]:
  noun = rng.choice(("picture", "image", "photo", "drawing" if style == "sketch" else "scene"))
  caps = []
  # 1. Enumeration.
  names = [_np(o, rng) for o in objs]
  listing = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
  caps.append(f"{_article(noun) + ' ' + noun + ' of' if rng.random() < 0.5 else 'there is'} {listing}.")
  # 2. Spatial relation between two objects (or position of the single one).
  if len(objs) >= 2:
    i, j = rng.choice(len(objs), size=2, replace=False)
    caps.append(f"{_np(objs[i], rng)} {_relation(objs[i], objs[j])} {_np(objs[j], rng)}.")
  else:
    caps.append(f"{_np(objs[0], rng)} {_where(objs[0], size)} of the {noun}.")
  # 3. Counts by shape.
  by_shape: dict[str, list[dict]] = {}
  for o in objs:
    by_shape.setdefault(o["shape"], []).append(o)
  parts = []
  for shape, group in by_shape.items():
    if len(group) == 1:
      parts.append(_np(group[0], rng, with_size=False))
    else:
      colors = sorted({g["color"] for g in group})
      col = colors[0] + " " if len(colors) == 1 else ""
      parts.append(f"{NUMBER_WORDS[len(group)]} {col}{plural(shape)}")
  caps.append(f"{' and '.join(parts)} {'on a plain background' if style == 'sketch' else 'in a colorful ' + noun}.")
  # 4. Positions of every object.
  caps.append(" , ".join(f"{_np(o, rng)} {_where(o, size)}" for o in objs) + ".")
  # 5. Total count and the largest object.
  largest = max(objs, key=lambda o: o["r"])
  n = len(objs)
  caps.append(
    f"{NUMBER_WORDS[n]} {'object' if n == 1 else 'objects'}, the biggest one is {_np(largest, rng, with_size=False)}."
  )
  return [c.replace(" .", ".") for c in caps]


def _narration(objs, rng, size):
  """A narration naming objects one by one, with per-word times and a mouse trace hovering over each."""
  words: list[tuple[str, int]] = [(w, -1) for w in "in this image we can see".split()]
  for k, o in enumerate(objs):
    if k:
      words.append(("and", -1))
    phrase = _np(o, rng).split() + _where(o, size).split()
    for w in phrase:
      words.append((w, k))
  words[-1] = (words[-1][0] + ".", words[-1][1])
  timed, trace = [], []
  t = rng.uniform(0.2, 0.8)
  mouse = np.array([rng.uniform(0, size), rng.uniform(0, size)])
  for w, k in words:
    dur = 0.15 + 0.06 * len(w) + rng.uniform(0, 0.15)
    start, end = t, t + dur
    timed.append({"utterance": w, "start_time": start, "end_time": end})
    # Mouse samples every 50 ms: jitter around the named object, a slow random walk otherwise.
    ts = np.arange(start, end, 0.05)
    if k >= 0:
      o = objs[k]
      pts = np.array([o["cx"], o["cy"]]) + rng.normal(scale=o["r"] * 0.3, size=(len(ts), 2))
    else:
      pts = mouse + np.cumsum(rng.normal(scale=size * 0.02, size=(len(ts), 2)), axis=0)
    pts = np.clip(pts, 0, size - 1)
    mouse = pts[-1]
    trace.append(np.column_stack([pts / size, ts]))
    t = end + rng.uniform(0.0, 0.1)
  trace = np.concatenate(trace).astype(np.float32)  # [N, 3]: x, y (normalised), t (seconds)
  text = " ".join(w for w, _ in words)
  return text, timed, trace


def _qa_and_entailment(objs, rng):
  qa = []
  present_shapes = {o["shape"] for o in objs}
  shape = rng.choice(SHAPES)
  qa.append((f"is there a {shape}?", "yes" if shape in present_shapes else "no"))
  color = rng.choice(COLOR_NAMES)
  qa.append((f"how many {color} objects are there?", NUMBER_WORDS[sum(o["color"] == color for o in objs)]))
  o = objs[rng.integers(len(objs))]
  qa.append((f"what color is the {o['size']} {o['shape']}?", o["color"]))
  qa.append(("how many objects are there?", NUMBER_WORDS[len(objs)]))
  if len(objs) >= 2:
    a, b = rng.choice(len(objs), size=2, replace=False)
    rel = _relation(objs[a], objs[b]).replace("to the ", "").replace(" of", "")
    qa.append(
      (
        f"where is the {objs[a]['color']} {objs[a]['shape']} relative to the {objs[b]['color']} {objs[b]['shape']}?",
        rel,
      )
    )
  ent = []
  ent.append((f"there is {_np(o, rng, with_size=False)}.", 0))
  absent = [s for s in SHAPES if s not in present_shapes]
  ent.append((f"there is a {rng.choice(absent)} in the picture.", 1))
  n = len(objs)
  ent.append((f"there are {NUMBER_WORDS[min(n + 1 + int(rng.integers(2)), 6)]} objects.", 1))
  ent.append((f"the {o['shape']} is made of {rng.choice(_MATERIALS)}.", 2))
  return qa, ent


def generate_scene(
  rng: np.random.Generator, image_size: int = 64, style: str = "main", max_objects: int = MAX_OBJECTS
) -> dict[str, Any]:
  """Generates one annotated scene. Coordinates of traces and boxes are normalised to [0, 1]."""
  if style not in STYLES:
    raise ValueError(f"Unknown style {style!r}; known: {STYLES}")
  scale = 2  # draw at 2x and downsample for anti-aliasing
  big = image_size * scale
  n = int(rng.integers(1, max_objects + 1))
  objs = []
  for _ in range(n):
    size = SIZES[int(rng.integers(2))]
    r = big * rng.uniform(*RADIUS[size])
    # Rejection-sample positions with limited overlap (some occlusion is allowed and marked).
    for _try in range(20):
      cx, cy = rng.uniform(r, big - r, size=2)
      if all(math.hypot(cx - p["cx"], cy - p["cy"]) > 0.6 * (r + p["r"]) for p in objs):
        break
    objs.append(
      {
        "shape": SHAPES[int(rng.integers(len(SHAPES)))],
        "color": COLOR_NAMES[int(rng.integers(len(COLORS)))],
        "size": size,
        "r": r,
        "cx": cx,
        "cy": cy,
        "angle": rng.uniform(0, 2 * math.pi),
      }
    )

  bg = _background(rng, big, style)
  canvas = Image.fromarray(bg)
  draw = ImageDraw.Draw(canvas)
  full_masks = []
  for o in objs:
    m = Image.new("L", (big, big), 0)
    _draw_shape(ImageDraw.Draw(m), o["shape"], o["cx"], o["cy"], o["r"], o["angle"], fill=255)
    full_masks.append(np.asarray(m) > 127)
    rgb = tuple(int(np.clip(c + rng.normal(scale=12), 0, 255)) for c in COLORS[o["color"]])
    if style == "main":
      _draw_shape(draw, o["shape"], o["cx"], o["cy"], o["r"], o["angle"], fill=rgb)
    else:
      # Sketch: paper-coloured fill with a coloured outline and hatching strokes inside the shape.
      _draw_shape(
        draw,
        o["shape"],
        o["cx"],
        o["cy"],
        o["r"],
        o["angle"],
        fill=tuple(bg[0, 0]),
        outline=rgb,
        width=max(2, big // 40),
      )
      hatch = Image.new("RGB", (big, big), tuple(bg[0, 0]))
      hd = ImageDraw.Draw(hatch)
      for k in range(-big, big, max(4, big // 12)):
        hd.line([(k, 0), (k + big, big)], fill=rgb, width=1)
      inner = Image.fromarray(((full_masks[-1] & (rng.random() < 0.7)) * 255).astype(np.uint8))
      inner = inner.filter(ImageFilter.MinFilter(5))
      canvas.paste(hatch, (0, 0), inner)
  if style == "main":
    canvas = canvas.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0, 1.0)))
  image = np.asarray(canvas.resize((image_size, image_size), Image.BILINEAR))

  # Visible masks: later objects occlude earlier ones.
  objects = []
  for k, o in enumerate(objs):
    vis = full_masks[k].copy()
    for later in full_masks[k + 1 :]:
      vis &= ~later
    vis_small = (
      np.asarray(Image.fromarray(vis.astype(np.uint8) * 255).resize((image_size, image_size), Image.BILINEAR)) > 127
    )
    visible_fraction = vis.sum() / max(full_masks[k].sum(), 1)
    ys, xs = np.nonzero(full_masks[k])
    bbox = np.array([ys.min(), xs.min(), ys.max() + 1, xs.max() + 1], np.float32) / big
    objects.append(
      {
        "shape": o["shape"],
        "color": o["color"],
        "size": o["size"],
        "bbox": bbox,
        "mask": vis_small,
        "visible_fraction": float(visible_fraction),
        # VOC convention: heavily occluded objects are 'difficult' and ignored by the probe metric.
        "difficult": bool(visible_fraction < 0.35),
        "cx": o["cx"] / scale,
        "cy": o["cy"] / scale,
        "r": o["r"] / scale,
      }
    )
  # Captions and narration read objects left to right, as people tend to describe scenes.
  ordered = sorted(objects, key=lambda o: o["cx"])
  captions = _captions(ordered, rng, image_size, style)
  narration, timed, trace = _narration(ordered, rng, image_size)
  qa, ent = _qa_and_entailment(objects, rng)
  return {
    "image": image,
    "captions": captions,
    "objects": objects,
    "narration": narration,
    "timed_caption": timed,
    "traces": trace,
    "questions": qa,
    "entailment": ent,
    "style": style,
  }


def make_record(job) -> dict[str, Any]:
  """One example in the `synthetic_scenes` TFDS feature layout (plain python/numpy, picklable for workers)."""
  seed, image_size, style, index = job
  s = generate_scene(np.random.default_rng(seed), image_size, style)
  object_map = np.zeros((image_size, image_size, 1), np.uint8)
  for k, o in enumerate(s["objects"]):
    object_map[o["mask"], 0] = k + 1
  return {
    "image": s["image"],
    "image_id": index,
    "style": style,
    "captions": s["captions"],
    "narration": s["narration"],
    "timed_caption": s["timed_caption"],
    "traces": s["traces"],
    "objects": [
      {
        "label": o["shape"],
        "color": o["color"],
        "size": o["size"],
        "bbox": tuple(np.clip(o["bbox"], 0, 1).tolist()),
        "is_difficult": o["difficult"],
      }
      for o in s["objects"]
    ],
    "object_map": object_map,
    "questions": [{"question": q, "answer": a} for q, a in s["questions"]],
    "entailment": [{"statement": st, "label": lab} for st, lab in s["entailment"]],
  }


def png(array: np.ndarray) -> bytes:
  """PNG bytes of a uint8 [H, W, C] array (C = 1 or 3), as TFDS's Image feature stores them."""
  buffer = io.BytesIO()
  Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(buffer, format="PNG", compress_level=1)
  return buffer.getvalue()


def make_encoded_record(job) -> dict[str, Any]:
  """make_record with its images already PNG-encoded: the builder's worker processes do the encoding, which the
  main process (serialising and writing every record) would otherwise do alone, the bottleneck of generation."""
  record = make_record(job)
  record["image"], record["object_map"] = png(record["image"]), png(record["object_map"])
  return record
