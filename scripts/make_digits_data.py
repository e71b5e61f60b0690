"""Make ``data/digits/{train,test}.parquet``: a small real image dataset for vision-language models (seeded, offline).

The source is scikit-learn's bundled copy of the UCI ML hand-written digits (``sklearn.datasets.load_digits()``:
1,797 images of 8x8 pixels, values 0-16, the number of "on" pixels in each 4x4 block of a 32x32 bitmap; shipped
inside the scikit-learn package, nothing is downloaded). Each image is scaled back to 32x32 by nearest-neighbour
(every 8x8 value becomes a uniform 4x4 block: lossless, and PNG keeps it to about 240 bytes an image, where bilinear
takes 1.1 kB), drawn as a black digit on a white background (value 16 -> 0, value 0 -> 255, 17 grey levels), made
RGB (three equal channels) and PNG-encoded. A stratified split (``train_test_split(..., stratify=label,
random_state=0)``) gives 1,497 training and 300 test rows, every digit in both (145-152 and 29-31 of each).

Columns (TRL's conversational vision form; written with the ``datasets`` library, so ``images`` is a list of
``datasets.Image`` features, each stored as a struct ``{bytes, path}``, and ``load_dataset("parquet", ...)`` gives
PIL images back):

- ``images``: a list of one image;
- ``messages``: ``[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
  {"role": "assistant", "content": [{"type": "text", "text": "7"}]}]`` (for SFT);
- ``prompt``: the user turn only, the same list-of-one-message form (for GRPO);
- ``answer``: the digit as a string; ``label``: the digit as an int.

Arrow stores a message part as the struct ``{type, text}``, so the image part reads back as
``{"type": "image", "text": None}`` (as in TRL's own vision datasets); chat templates test ``type`` first.

    python scripts/make_digits_data.py            # writes data/digits/train.parquet and test.parquet
    python scripts/make_digits_data.py --out DIR  # the same files into DIR (tests/test_vlm_assets.py compares them)
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "digits"
QUESTION = "Which digit is this? Answer with one digit."
SIZE = 32
TEST_ROWS = 300
SEED = 0


def to_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of one 8x8 digit (values 0-16): scaled to ``SIZE`` x ``SIZE`` (nearest), black on white, RGB."""
    from PIL import Image

    gray = np.round(255.0 - pixels * (255.0 / 16.0)).astype(np.uint8)
    image = Image.fromarray(gray, mode="L").resize((SIZE, SIZE), Image.NEAREST).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def rows(images: np.ndarray, labels: np.ndarray) -> dict[str, list]:
    """The columns of the rows of ``images`` / ``labels``."""
    user = {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTION}]}
    return {
        "images": [[{"bytes": to_png(image), "path": None}] for image in images],
        "messages": [[user, {"role": "assistant", "content": [{"type": "text", "text": str(y)}]}]
                     for y in labels],
        "prompt": [[user] for _ in labels],
        "answer": [str(int(y)) for y in labels],
        "label": [int(y) for y in labels],
    }


def main(argv: list[str] | None = None) -> int:
    """Build both splits; prints the row counts, the digits per split and the file sizes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write train.parquet and test.parquet in")
    out = parser.parse_args(argv).out
    import datasets
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=TEST_ROWS, stratify=digits.target, random_state=SEED)
    part = datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")})
    message = {"role": datasets.Value("string"), "content": part}
    features = datasets.Features({
        "images": datasets.List(datasets.Image()),
        "messages": datasets.List(message),
        "prompt": datasets.List(message),
        "answer": datasets.Value("string"),
        "label": datasets.Value("int64"),
    })
    out.mkdir(parents=True, exist_ok=True)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        path = out / f"{split}.parquet"
        datasets.Dataset.from_dict(rows(x, y), features=features).to_parquet(str(path))
        counts = np.bincount(y, minlength=10).tolist()
        print(f"{path}: {len(y)} rows, per digit {counts}, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
