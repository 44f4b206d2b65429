"""The reference vision encoder: a Qwen2-VL-style ViT whose graphs serve every split of a token count.

A packed batch of images (any number, any grid) is ``S`` patches; the image boundaries travel in a
static ``cu_seqlens`` buffer the attention reads on the device (and, for Qwen2.5-VL-style windowed
attention, the window boundaries and order in ``cu_window_seqlens`` / ``window_index``), so one graph
per token bucket replays correctly for every split of that bucket into images. The encoder runner
captures buckets lazily, on first sight, and can bound how many graphs (and bytes) it keeps::

    model = VisionEncoder(VisionConfig.preset("tiny"), device="cpu", seed=0)
    runner = encoder_runner(model, max_graphs=8)
    runner.capture()                                   # lazy: captures nothing yet
    batch = make_image_batch(model, [(8, 8), (4, 12)])  # two images, 112 patches
    merged = encode(runner, batch)                      # [28, out_hidden]: bucket 128 captured
"""

from devgraph.reference.encoder.attention import IMAGE_ATTENTION_OP_NAME, image_sdpa, varlen_image_attention
from devgraph.reference.encoder.batch import (
    EncoderContext,
    ImageBatch,
    image_positions,
    make_image_batch,
    window_order,
)
from devgraph.reference.encoder.config import ENCODER_ATTENTION, ENCODER_PRESETS, VisionConfig
from devgraph.reference.encoder.model import VisionBlock, VisionEncoder
from devgraph.reference.encoder.runner import (
    DEFAULT_MAX_IMAGES,
    MERGED,
    TOKEN_STEP,
    WINDOWS,
    encode,
    encoder_inputs,
    encoder_runner,
    encoder_sizes,
)

__all__ = [
    "DEFAULT_MAX_IMAGES",
    "ENCODER_ATTENTION",
    "ENCODER_PRESETS",
    "IMAGE_ATTENTION_OP_NAME",
    "MERGED",
    "TOKEN_STEP",
    "WINDOWS",
    "EncoderContext",
    "ImageBatch",
    "VisionBlock",
    "VisionConfig",
    "VisionEncoder",
    "encode",
    "encoder_inputs",
    "encoder_runner",
    "encoder_sizes",
    "image_positions",
    "image_sdpa",
    "make_image_batch",
    "varlen_image_attention",
    "window_order",
]
