"""The miles-diffusion reference's command-line flag surface, as data.

:data:`FLAGS` lists every flag of the reference CLI (``train_diffusion.py``, "Complete
reference" of its CLI reference page) with the same names, types and defaults, grouped by
the keys of :data:`miles_core.config.flag.GROUPS` and kept in the reference's order within
each group; the parser, the typed configuration, the YAML loader and the generated
``docs/cli.md`` are all built from it. Where our default deliberately differs from the
reference's (machine-resolved ``auto`` defaults, model-family defaults, the built-in
rollout function), the flag carries ``reference_default`` and ``differs``, and
``docs/cli.md`` renders those differences. Plugin-owned flags (the PickScore and OCR
rewards' ``--pickscore-*`` / ``--ocr-*``) and the ``--sglang-*`` engine pass-through flags
are not in this table.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from miles_core.config.flag import Flag

_PATH = "MODULE.ATTR"
_GPU_COUNT = "N|auto"


def _f(group: str, name: str, type: str, default: Any, help: str, **extra: Any) -> Flag:
    return Flag(name=name, group=group, type=type, default=default, help=help, **extra)


def _hook(group: str, name: str, help: str, path_kind: str = "callable", **extra: Any) -> Flag:
    """A dotted-path flag naming code (``module.attr``)."""
    return Flag(name=name, group=group, type="str", default=None, help=help, path_kind=path_kind, metavar=_PATH, **extra)


_AUTO_GPUS = "The reference assumes 8-GPU nodes; auto uses the number of visible GPUs, and a single process on a CPU-only machine."

_NO_GUARD = "Added: the reference has no reward-hacking guard."
GUARD_THRESHOLD = 2.0
"""--guard-threshold's default, in spreads (docs/guide.md, "Reward-hacking guard": how it was chosen)."""
GUARD_KL_MAX = 0.05
"""--guard-kl-max's default."""

_TABLE: tuple[Flag, ...] = (
    # ------------------------------------------------------------------ general
    _f(
        "general",
        "--custom-config-path",
        "str",
        None,
        "YAML file whose keys are loaded into the configuration after parsing; a key that collides with a flag overrides it (with a warning), so the YAML wins over the command line.",
        metavar="FILE.yaml",
    ),
    # ------------------------------------------------------------------ cluster
    _f("cluster", "--actor-num-nodes", "int", 1, "Nodes for the training actor.", range="[1, inf)"),
    _f(
        "cluster",
        "--actor-num-gpus-per-node",
        "str",
        "auto",
        "GPUs per training-actor node, an integer or 'auto'; the train world size is nodes × this.",
        auto=True,
        metavar=_GPU_COUNT,
        reference_default="8",
        differs=_AUTO_GPUS,
    ),
    _f(
        "cluster",
        "--rollout-num-gpus",
        "int",
        None,
        "GPUs for rollout-side work; forced to the train world size under --colocate. For train-only SFT, unset colocates the encoders with training and a value reserves dedicated encoder GPUs.",
        range="[1, inf)",
    ),
    _f(
        "cluster",
        "--rollout-num-gpus-per-engine",
        "int",
        1,
        "GPUs per rollout engine (its TP × SP), like sglang's tp_size.",
        range="[1, inf)",
    ),
    _f(
        "cluster",
        "--num-gpus-per-node",
        "str",
        "auto",
        "Total GPUs the job may use per node, an integer or 'auto'.",
        auto=True,
        metavar=_GPU_COUNT,
        reference_default="8",
        differs=_AUTO_GPUS,
    ),
    _f(
        "cluster",
        "--colocate",
        "bool",
        False,
        "Run trainer and engines on the same GPUs, taking turns: turns on --offload-train and --offload-rollout unless "
        "set. Under --use-ray the engine servers the run starts share the training devices (trainer 0.7, engine 0.25 of "
        "each) instead of taking devices of their own.",
    ),
    _f(
        "cluster",
        "--use-ray",
        "bool",
        False,
        "Not in the reference. Run the training ranks, the engine servers the run starts (--rollout-num-engines) and the "
        "reward workers (serve-reward processes) on Ray actors in one placement group sized by the cluster flags (CPUs stand in for GPUs on a machine "
        "without them). Needed for a train world size above 1 (FSDP2 ranks). Starts a local Ray instance unless "
        "--ray-address names a cluster.",
        reference_default="(no such flag)",
        differs="The reference always runs on Ray; here a one-process run is the default and Ray is opt-in "
        "(pip install 'miles-core[ray]'), so a laptop run needs no Ray.",
    ),
    _f(
        "cluster",
        "--ray-address",
        "str",
        None,
        "Not in the reference. Address of a running Ray cluster to run on (ray start --head; auto finds the local one); implies --use-ray.",
        metavar="ADDRESS",
        reference_default="(no such flag)",
        differs="The reference joins the cluster its job was submitted to; here it is named explicitly.",
    ),
    _f(
        "cluster",
        "--offload",
        "bool",
        False,
        "Shorthand for --offload-train plus --offload-rollout (--no-offload-train or --no-offload-rollout with it is an error).",
    ),
    _f(
        "cluster",
        "--offload-train",
        "tristate",
        None,
        "Move the trainer's state to CPU memory (pinned with CUDA) while the engine generates and evaluates, and back "
        "before training: with a remote engine (or the training ranks of --use-ray) its parameters, gradients, optimizer "
        "state and EMA; with the embedded engine, which samples the trainer's modules, the gradients, optimizer state and "
        "EMA. On under --offload and --colocate unless set (--no-offload-train with --colocate is an error).",
    ),
    _f(
        "cluster",
        "--offload-rollout",
        "tristate",
        None,
        "Release the engine's memory while the trainer trains, and resume it before the weight sync: the embedded "
        "engine's modules the trainer does not run (VAE, text encoders), every serve-engine or sglang-diffusion server's "
        "pipeline (POST /release_memory_occupation). On under --offload and --colocate unless set "
        "(--no-offload-rollout with --colocate is an error).",
    ),
    _f(
        "cluster",
        "--distributed-backend",
        "str",
        "auto",
        "torch.distributed backend for training; auto picks nccl with GPUs and gloo without.",
        auto=True,
        reference_default="nccl",
        differs="nccl needs GPUs; auto uses nccl when GPUs are visible and gloo on a CPU-only machine.",
    ),
    _f("cluster", "--distributed-timeout-minutes", "int", 10, "Timeout of torch.distributed collectives, in minutes.", range="[1, inf)"),
    _f(
        "cluster",
        "--cpu-threads",
        "int",
        None,
        "Not in the reference. Torch threads of the process's compute thread (the one thread that runs generation, "
        "training and evaluation); every other thread that calls torch (reward scoring, response decoding) runs on one. "
        "Unset: the thread plan decides from the machine and the configuration (docs/guide.md, 'Threads'): on a CPU, "
        "every usable core (or OMP_NUM_THREADS when set); with GPUs, the cores left after the reward and decode "
        "workers. More than the machine's cores is a warning, not an error.",
        range="[1, inf)",
        metavar="N",
        reference_default="(no such flag)",
        differs="Added: the reference leaves threads to torch's default, which on a CPU gives each thread that calls "
        "torch an OpenMP team of all the cores; two teams in one process made a 2-core run 1.22x slower than at one thread "
        "(1.91x a hand-written loop's time); here one compute thread holds the cores.",
    ),
    # ------------------------------------------------------------------ training backend
    _f("training_backend", "--train-backend", "str", "fsdp", "Training backend; fsdp is the only value.", choices=("fsdp",)),
    _f(
        "training_backend",
        "--fsdp-master-dtype",
        "str",
        "fp32",
        "Precision of the master weights and the optimizer state (the FSDP2 shards, or the one-process trainer's master copies); "
        "the forward runs in --diffusion-forward-dtype.",
        choices=("fp32", "bf16", "fp16"),
    ),
    _f(
        "training_backend",
        "--fsdp-reduce-dtype",
        "str",
        "fp32",
        "Gradient reduce-scatter precision; bf16 matches flow_grpo's all-bf16 policy but adds cross-rank add-noise.",
        choices=("fp32", "bf16", "fp16"),
    ),
    _f(
        "training_backend",
        "--diffusion-forward-dtype",
        "str",
        "auto",
        "DiT forward compute dtype: engine, FSDP param_dtype and the training-side input cast; auto picks bf16 on GPU and fp32 on CPU.",
        choices=("auto", "bf16", "fp16", "fp32"),
        auto=True,
        reference_default="bf16",
        differs="bf16 compute is slow or unsupported on CPU; auto uses bf16 on GPU and fp32 on a CPU-only machine.",
    ),
    _f(
        "training_backend",
        "--fsdp-cpu-offload",
        "bool",
        False,
        "Offload params, grads and optimizer state to CPU; the optimizer step then runs on CPU.",
    ),
    _f("training_backend", "--fsdp-cpu-backend", "str", "gloo", "CPU process-group backend used with --fsdp-cpu-offload."),
    _f(
        "training_backend",
        "--dp-replicate-size",
        "int",
        1,
        "Hybrid-sharding replica count; dp_shard takes the ranks left over after this and sequence parallelism.",
        range="[1, inf)",
    ),
    _f("training_backend", "--sequence-parallel-size", "int", 1, "Sequence-parallel (USP = Ulysses × Ring) size.", range="[1, inf)"),
    _f(
        "training_backend",
        "--ulysses-degree",
        "int",
        0,
        "Ulysses degree within sequence parallelism; 0 = auto (Ulysses fills SP). A ring degree > 1 needs torch >= 2.11 and a ring-capable attention backend.",
        range="[0, inf)",
    ),
    _f("training_backend", "--fsdp-attention-backend", "str", None, "diffusers set_attention_backend value for the trained model."),
    _f(
        "training_backend",
        "--fsdp-flow-shift",
        "float",
        None,
        "Training-side sigma-grid shift, used when no engine supplies scheduler metadata (SFT); distinct from --diffusion-flow-shift.",
        range="(0, inf)",
    ),
    _f("training_backend", "--gradient-checkpointing", "bool", False, "Recompute activations in backward to save memory."),
    _f(
        "training_backend",
        "--gpu-memory-gb",
        "float",
        80.0,
        "Not in the reference. The memory of one GPU, in GiB, that `miles-core plan` holds a plan against when no GPU is "
        "visible (a visible GPU's own memory is used otherwise; `train` on a machine without a GPU holds its plan against the "
        "host's available memory).",
        range="(0, inf)",
        metavar="GIB",
        reference_default="(no such flag)",
        differs="Added with the memory planner (miles-core plan).",
    ),
    _f(
        "training_backend",
        "--skip-memory-plan",
        "bool",
        False,
        "Not in the reference. Start training without the memory plan `train` otherwise makes before reading any weight "
        "(the same plan `miles-core plan` prints; a configuration whose peak exceeds the device's memory stops there, exit 2).",
        reference_default="(no such flag)",
        differs="Added with the memory planner: the reference checks nothing before loading.",
    ),
    _f("training_backend", "--deterministic-mode", "bool", False, "Deterministic training (deterministic kernels and seeding)."),
    _f(
        "training_backend",
        "--train-env-vars",
        "json",
        {},
        "Extra environment variables for the training processes, as a JSON object.",
        metavar="JSON",
    ),
    _f(
        "training_backend",
        "--compile",
        "bool",
        False,
        "Not in the reference. Compile the diffusion transformer's repeated blocks with torch.compile (regional "
        "compilation: one compiled graph per block shape, so compile time stays bounded) in the engine and the trainer; "
        "serve-engine servers the run starts get it too. The first call of each shape pays the compile. Refused with "
        "FSDP2 ranks or sequence parallelism, and where inductor cannot compile (no C++ compiler; no triton on a GPU).",
        reference_default="(no such flag)",
        differs="Added: the reference runs eager; compiling is opt-in because each new shape costs a compile and "
        "compiled kernels may round differently from eager ones (docs/guide.md, 'Compiled transformer').",
    ),
    # ------------------------------------------------------------------ optimizer and schedule
    _f("optimizer", "--optimizer", "str", "adam", "Optimizer; adam (AdamW) is the only value.", choices=("adam",)),
    _f("optimizer", "--lr", "float", 1e-6, "Learning rate.", range="[0, inf)"),
    _f("optimizer", "--adam-beta1", "float", 0.9, "AdamW beta1.", range="[0, 1)"),
    _f("optimizer", "--adam-beta2", "float", 0.999, "AdamW beta2; matches flow_grpo, not the LLM-side 0.95.", range="[0, 1)"),
    _f("optimizer", "--adam-eps", "float", 1e-8, "AdamW epsilon.", range="(0, inf)"),
    _f("optimizer", "--weight-decay", "float", 0.0, "AdamW weight decay.", range="[0, inf)"),
    _f("optimizer", "--clip-grad", "float", 1.0, "Gradient-norm clipping threshold.", range="[0, inf)"),
    _f(
        "optimizer", "--lr-decay-style", "str", "constant", "Learning-rate decay schedule.", choices=("constant", "linear", "cosine", "wsd")
    ),
    _f("optimizer", "--min-lr", "float", 0.0, "Floor the learning rate decays to.", range="[0, inf)"),
    _f("optimizer", "--lr-warmup-init", "float", 0.0, "Learning rate at the start of warmup.", range="[0, inf)"),
    _f("optimizer", "--lr-warmup-iters", "int", 0, "Warmup length in optimizer steps; 0 disables warmup.", range="[0, inf)"),
    _f("optimizer", "--lr-warmup-fraction", "float", None, "Warmup length as a fraction of the decay iterations.", range="[0, 1]"),
    _f("optimizer", "--lr-decay-iters", "int", None, "Optimizer steps over which the learning rate decays.", range="[1, inf)"),
    _f(
        "optimizer",
        "--lr-wsd-decay-iters",
        "int",
        None,
        "Warmup-stable-decay: length of the final decay phase, in optimizer steps.",
        range="[1, inf)",
    ),
    _f(
        "optimizer",
        "--lr-wsd-decay-style",
        "str",
        None,
        "Warmup-stable-decay: shape of the final decay phase.",
        choices=("linear", "cosine", "exponential", "minus_sqrt"),
    ),
    _f(
        "optimizer",
        "--use-checkpoint-lr-scheduler",
        "tristate",
        True,
        "Restore the learning-rate scheduler state from the loaded checkpoint (on by default).",
    ),
    _f("optimizer", "--override-lr-scheduler", "bool", False, "Ignore the checkpoint's scheduler state and use the command-line schedule."),
    _f("optimizer", "--seed", "int", 1234, "Random seed for training.", range="[0, 4294967295]"),
    # ------------------------------------------------------------------ rollout
    _f(
        "rollout",
        "--hf-checkpoint",
        "str",
        None,
        "Required. The diffusers pipeline to train and to serve (HF repo id or local directory); also where the model family is matched from.",
    ),
    _f(
        "rollout",
        "--diffusion-model-family",
        "str",
        None,
        "Registered model-family key (sd3, wan2_2, ltx, qwen_image, cosmos3, ...); overrides matching on the checkpoint (its model_index.json, else its name).",
        registry="model_family",
    ),
    _hook(
        "rollout",
        "--rollout-function-path",
        "Rollout function; unset runs this project's built-in diffusion rollout.",
        reference_default="miles.rollout.sglang_rollout.generate_rollout",
        differs="The reference's default is the generic LLM rollout that every diffusion recipe overrides; unset here runs this project's built-in diffusion rollout.",
    ),
    _hook(
        "rollout",
        "--train-pipeline-config-path",
        "Your own TrainPipelineConfig for an unregistered family; mutually exclusive with --diffusion-model-family.",
        path_kind="model_family",
    ),
    _hook("rollout", "--model-backend-path", "Override the model family's model loader."),
    _f("rollout", "--diffusion-num-steps", "int", 10, "Denoising steps per rollout sample.", range="[1, inf)"),
    _f(
        "rollout",
        "--diffusion-flow-shift",
        "float",
        None,
        "Generation-schedule shift sent to the engine; distinct from --fsdp-flow-shift.",
        range="(0, inf)",
    ),
    _f(
        "rollout",
        "--rollout-microgroup-size",
        "int",
        None,
        "Samples per prompt sent in one POST /rollout/generate; unset takes the model family's recipe value, capped at --n-samples-per-prompt.",
        reference_default="1",
        differs="The best microgroup size depends on the model; unset takes the model family's recipe microgroup size, capped at --n-samples-per-prompt.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--diffusion-fps",
        "float",
        None,
        "Output frame rate; video only. Under SFT, the clip's frame rate (what ltx and cosmos3 condition on; ltx reads "
        "num_frames / fps seconds of audio).",
        range="(0, inf)",
    ),
    _f(
        "rollout",
        "--diffusion-output-num-frames",
        "int",
        1,
        "Output frames per sample; 1 for images. Under SFT, the frames of each clip (every --sft-frame-stride-th of the video).",
        range="[1, inf)",
    ),
    _f("rollout", "--diffusion-guidance-scale", "float", 4.0, "Classifier-free guidance scale.", range="[0, inf)"),
    _f(
        "rollout",
        "--diffusion-guidance-scale-2",
        "float",
        None,
        "Guidance scale of Wan2.2's low-noise expert; required when training it.",
        range="[0, inf)",
    ),
    _f("rollout", "--diffusion-true-cfg-scale", "float", None, "True-CFG scale for pipelines that use it.", range="[0, inf)"),
    _f(
        "rollout",
        "--diffusion-negative-prompt",
        "str",
        None,
        'Negative prompt; when CFG is on and this is unset, the family\'s default (" " for most; "" where the pipeline says so).',
    ),
    _f("rollout", "--diffusion-noise-level", "float", 0.7, "SDE noise injected during rollout.", range="[0, inf)"),
    _f(
        "rollout",
        "--diffusion-height",
        "int",
        None,
        "Rollout output height and SFT center-crop height; unset takes the pipeline's native size.",
        reference_default="512",
        differs="Pipelines have different native resolutions; unset takes the pipeline's native size as diffusers resolves it.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--diffusion-width",
        "int",
        None,
        "Rollout output width and SFT center-crop width; unset takes the pipeline's native size.",
        reference_default="512",
        differs="Pipelines have different native resolutions; unset takes the pipeline's native size as diffusers resolves it.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--diffusion-sde-type",
        "str",
        None,
        "Rollout dynamics (sde, cps, ode); also selects the train-side SDE step backend. Unset takes the model family's default.",
        registry="sde_backend",
        reference_default="sde",
        differs="The right dynamics depend on the model; unset takes the model family's default (cps for LTX).",
    ),
    _hook(
        "rollout",
        "--sde-step-backend-path",
        "Your own SdeStepBackend class; overrides the --diffusion-sde-type mapping.",
        path_kind="sde_backend",
    ),
    _f("rollout", "--diffusion-num-sde-steps", "int", 0, "How many denoising steps become train pairs; 0 disables.", range="[0, inf)"),
    _f(
        "rollout",
        "--diffusion-sde-window-range",
        "int_pair",
        None,
        "Step window [lo, hi) for the sde_window strategy, 'lo,hi', hi at most --diffusion-num-steps; defaults to "
        "[0, num_inference_steps - 1). The last step is never an SDE step: a window that reaches it (the reference's "
        "default [0, num_inference_steps)) runs it as the deterministic Euler step, untrained, so it trains one step fewer.",
        metavar="LO,HI",
        range="[0, inf)",
    ),
    _f(
        "rollout",
        "--diffusion-sde-candidate-steps",
        "int_list",
        None,
        "Candidate steps, '1,2,3'; required by the epoch_global_random_choice strategy.",
        metavar="S1,S2,...",
        range="[0, inf)",
    ),
    _hook(
        "rollout",
        "--diffusion-step-strategy-path",
        "Which steps become train pairs: a registered step strategy's name (miles-core list-plugins; e.g. "
        "epoch_global_random_choice, mixgrpo) or pkg.mod:func; overrides the bare --diffusion-num-sde-steps selection.",
    ),
    _f("rollout", "--diffusion-log-prob-no-const", "bool", False, "Drop log-prob constants on the engine (pairs with the CPS backend)."),
    _f(
        "rollout",
        "--vae-decode-batch-size",
        "int",
        1,
        "Not in the reference. Outputs the embedded engine (and our HTTP server) decodes with the VAE at once; each "
        "chunk's pixels go to host memory before the next decodes, so the device holds one chunk's decoder activations "
        "and pixels instead of a whole microgroup's.",
        range="[1, inf)",
        metavar="N",
        reference_default="(no such flag; a whole batch at once)",
        differs="One output at a time by default: a microgroup of 8 videos of 121 frames at 704x1280 is 10.5 GB of "
        "fp32 pixels before the decoder's activations; the result differs from a whole-batch decode only by the "
        "kernels' rounding (docs/benchmarks.md, 'VAE decode in chunks').",
    ),
    _f(
        "rollout",
        "--vae-tiling",
        "bool",
        False,
        "Not in the reference. Decode (and, for SFT, encode) with the VAE's own spatial tiling (diffusers' enable_tiling: "
        "overlapping tiles blended at their seams), which bounds the decoder's activations by the tile instead of the "
        "frame; an error for a VAE without it. The pixels differ slightly at the seams.",
        reference_default="(no such flag)",
        differs="Added with the memory planner, which names it when the VAE decode is the peak.",
    ),
    _f(
        "rollout",
        "--diffusion-generator-device",
        "str",
        "auto",
        "Device of the per-output noise generators (sent as each request's generator_device): auto and cpu draw on "
        "the CPU (the model itself runs on a GPU when one is visible); cuda draws on the GPU the model runs on, seeded "
        "as on the CPU, but a CUDA generator's stream differs from the CPU's, so the latents are reproducible on the "
        "same GPU type only. cuda needs a visible NVIDIA GPU (but for --rollout-engine http, whose servers draw it).",
        auto=True,
        choices=("auto", "cpu", "cuda"),
        reference_default="cuda",
        differs="auto draws with CPU generators on every machine, so an output's noise depends only on its seed: the "
        "embedded engine, our server, sglang-diffusion (sent generator_device cpu) and a rerun on other hardware all "
        "draw the same latents. cuda (the reference's default) draws on the GPU: not bit-equal across devices.",
    ),
    _f("rollout", "--rollout-patch-group", "str", None, "Comma-separated numeric-parity patch groups, e.g. sgld,ltx."),
    _f(
        "rollout",
        "--update-weight-target-module",
        "str",
        "transformer",
        "Comma-separated modules to train and sync; unset, the model family's trainable components (Wan 2.2: transformer,transformer_2).",
        reference_default="transformer",
        differs="The family's trainable components when unset, so Wan 2.2 trains both experts without an extra flag "
        "(its steps fall on both sides of the expert boundary).",
    ),
    _f("rollout", "--update-weight-buffer-size", "int", 512 * 1024**2, "Weight-sync chunk size in bytes (512 MiB).", range="[1, inf)"),
    _f(
        "rollout",
        "--weight-sync-path",
        "str",
        "auto",
        "Not in the reference. How weight syncs reach the engines: cuda-ipc (CUDA-IPC handles in sglang-diffusion's "
        "update_weights_from_tensor format, an engine on the trainer's GPU: needs --colocate and CUDA), distributed (a "
        "torch.distributed group between training rank 0 and the engine servers, nccl with CUDA and gloo without, "
        "broadcast in --update-weight-buffer-size buckets; serve-engine servers), http (safetensors buckets over HTTP; "
        "serve-engine) or disk (safetensors files loaded with /update_weights_from_disk; --rollout-engine sglang). auto: "
        "cuda-ipc when colocated on CUDA, distributed for serve-engines the run places on GPUs of their own under "
        "--use-ray, else http (serve-engine) or disk (sglang).",
        choices=("auto", "cuda-ipc", "distributed", "http", "disk"),
        reference_default="(no such flag)",
        differs="The reference's sglang-diffusion engines are synced through the disk or CUDA-IPC handles; engines here "
        "are a registry with several transports, so the path is a choice (auto picks the one the reference would where "
        "it applies).",
    ),
    _f("rollout", "--rollout-seed", "int", 42, "Random seed for rollout generation.", range="[0, 4294967295]"),
    _f(
        "rollout",
        "--over-sampling-batch-size",
        "int",
        None,
        "Prompts sampled per rollout; must equal --rollout-batch-size today.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--sglang-server-concurrency",
        "int",
        512,
        "Requests in flight on each engine server at most (http and sglang engines: N servers carry up to N times "
        "this); the embedded engine, which runs one at a time, has at most this many of a rollout's requests queued.",
        range="[1, inf)",
    ),
    # Not in the reference, whose only engine is sglang-diffusion; ours is a registry.
    _f(
        "rollout",
        "--rollout-engine",
        "str",
        "embedded",
        "Rollout engine: embedded (in this process, over diffusers), http (servers speaking POST /rollout/generate, see --rollout-engine-urls), sglang (sglang-diffusion servers the run starts, see --sglang-python) or one a plugin registers.",
        registry="rollout_engine",
        reference_default="(no such flag)",
        differs="The reference always launches sglang-diffusion servers; engines here are a registry, and the default runs in-process so a run needs no server and no GPU.",
    ),
    _f(
        "rollout",
        "--rollout-engine-urls",
        "str",
        None,
        "Comma-separated base URLs of engine servers (http://127.0.0.1:30000,...), for --rollout-engine http.",
        metavar="URL[,URL...]",
        reference_default="(no such flag)",
        differs="Added with --rollout-engine: names already running servers (ours from miles-core serve-engine, or sglang-diffusion's).",
    ),
    _f(
        "rollout",
        "--api-key",
        "str",
        None,
        "Not in the reference. The key of engine servers started by hand (--rollout-engine-urls, each started with the same "
        "key) and of reward servers (--rm-url; miles-core serve-reward given a key requires it): every request but GET /health carries "
        "'Authorization: Bearer KEY', and a server that answers 401 stops the run at start-up. A command line shows in ps, so prefer --api-key-file or the MILES_API_KEY environment variable "
        "(read when neither flag is set); redacted in config.yaml and W&B's config, but W&B's run metadata records the "
        "command line, and with it this key. Servers the run starts get a fresh secret "
        "of the run instead.",
        metavar="KEY",
        reference_default="(no such flag)",
        differs="Added with --rollout-engine-urls: the reference's engine servers take no key.",
    ),
    _f(
        "rollout",
        "--api-key-file",
        "str",
        None,
        "Not in the reference. A file holding --api-key's key, readable by its owner only (chmod 600; a looser one is used "
        "with a warning).",
        metavar="PATH",
        reference_default="(no such flag)",
        differs="Added with --api-key.",
    ),
    _f(
        "rollout",
        "--rollout-num-engines",
        "int",
        None,
        "Not in the reference. With --rollout-engine http and no --rollout-engine-urls: start N miles-core serve-engine "
        "servers of --hf-checkpoint on free loopback ports (logs in the run's engines/ folder), sync weights to all of "
        "them, and stop them when the run ends. With --rollout-engine sglang: the number of sglang-diffusion servers "
        "it starts (default 1).",
        metavar="N",
        reference_default="(no such flag)",
        differs="Added with --rollout-engine http: the reference launches its sglang-diffusion engines from "
        "--rollout-num-gpus / --rollout-num-gpus-per-engine through Ray.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--sglang-python",
        "str",
        None,
        "Python of the separate sglang-diffusion environment, for --rollout-engine sglang (sglang pins its own torch, diffusers and transformers).",
        metavar="PATH",
        reference_default="(no such flag)",
        differs="The reference runs sglang-diffusion in the trainer's own environment.",
    ),
    _f(
        "rollout",
        "--use-distributed-post",
        "bool",
        False,
        "Send rollout HTTP POSTs through per-node Ray actors instead of the local client (MILES_HTTP_POST_ACTORS_PER_NODE sets the "
        "count): each posts to the engines on its node and decodes their answers there. Requires --use-ray and engine servers "
        "the run starts.",
    ),
    _f(
        "rollout",
        "--use-miles-router",
        "bool",
        False,
        "Route the rollout requests through the miles router: a separate process (miles-core router) the run starts in "
        "front of the engine servers it starts (--rollout-engine http --rollout-num-engines N), least busy engine first, "
        "health-checked, a request without an answer retried on another engine; weight syncs still go to each engine. "
        "The SGLang router is not supported.",
    ),
    _f(
        "rollout",
        "--miles-router-timeout",
        "float",
        None,
        "Seconds one /rollout/generate request to an http or sglang engine server may take (unset: no limit); a request past it "
        "fails, or under --use-fault-tolerance or --use-miles-router takes its server down and is retried on another.",
        range="(0, inf)",
    ),
    _f(
        "rollout",
        "--miles-router-max-connections",
        "int",
        None,
        "Connections the miles router keeps open to the engines at once, all together (its connection pool); a request "
        "waits for one. Unset: no cap beyond --sglang-server-concurrency per engine. --use-miles-router.",
        range="[1, inf)",
    ),
    _f(
        "rollout",
        "--miles-router-health-check-failure-threshold",
        "int",
        3,
        "Failed health checks in a row before an engine is taken out of routing (and restarted when the run started "
        "it); --use-fault-tolerance or --use-miles-router.",
        range="[1, inf)",
    ),
    # ------------------------------------------------------------------ data and batching
    _f("data", "--prompt-data", "str", None, "Prompt dataset: jsonl, one row per prompt."),
    _f(
        "data",
        "--precompute-prompt-embeddings",
        "bool",
        False,
        "Not in the reference. Encode every distinct training and evaluation prompt once at start-up (or load the "
        "encodings from --prompt-embeddings-cache), then free the text encoders for the rest of the run; the embedded "
        "engine, serve-engine servers the run starts (they preload them) and the trainer's SFT path use the stored "
        "encodings; results are the same as without it (each is the engine's own encode call, at the run's thread "
        "count). Not for other engines (sglang-diffusion servers, servers given by URL, plugins' engines: they "
        "encode themselves), --use-ray, a --data-source-path source (prompts unknown at start) or custom rollout, "
        "evaluation or generate functions: the run says so in one line and encodes per engine as without it.",
        reference_default="(no such flag)",
        differs="Added: the reference keeps the text encoders resident and encodes in the engine on every request.",
    ),
    _f(
        "data",
        "--prompt-embeddings-cache",
        "str",
        None,
        "Not in the reference. Folder of the --precompute-prompt-embeddings cache, keyed by the checksums of the "
        "frozen modules an encode runs, the family's settings and code, and every conditioning input; a corrupt entry "
        "is detected by its checksum and rebuilt. Unset: OUTPUT_DIR/prompt_embeddings.",
        metavar="DIR",
        reference_default="(no such flag)",
        differs="Added with --precompute-prompt-embeddings.",
    ),
    _f("data", "--input-key", "str", "input", "Key of the prompt text in each data row."),
    _f(
        "data",
        "--image-key",
        "str",
        "image",
        "Key of each --prompt-data and --eval-prompt-data row holding an image path, relative to the JSONL file's folder: "
        "the conditioning image of an image-to-video family (every row of a family that requires one; a text-only family "
        "never reads the key; the path must be readable where the engine runs), and the image `miles-core score` scores.",
        metavar="KEY",
        reference_default="(no such flag)",
        differs="Added with image-to-video: sglang-diffusion takes the image as the request's image_path.",
    ),
    _f("data", "--metadata-key", "str", "metadata", "Key of the per-sample metadata in each data row."),
    _hook("data", "--data-source-path", "Rollout data source class; defaults to RolloutDataSourceWithBuffer."),
    _f("data", "--disable-rollout-global-dataset", "bool", False, "Do not load the global prompt dataset; manage data yourself."),
    _f("data", "--rollout-batch-size", "int", None, "Prompts per rollout; no default, every recipe sets it.", range="[1, inf)"),
    _f("data", "--n-samples-per-prompt", "int", 1, "Samples per prompt (the GRPO group size).", range="[1, inf)"),
    _f(
        "data",
        "--global-batch-size",
        "int",
        None,
        "Samples per optimizer step; must divide by the data-parallel size. Derived when unset.",
        range="[1, inf)",
    ),
    _f("data", "--num-steps-per-rollout", "int", None, "Optimizer steps per rollout; derived when unset.", range="[1, inf)"),
    _f(
        "data",
        "--micro-batch-size",
        "int",
        1,
        "Flat cut: train pairs per DiT forward, contiguous within an optimizer window.",
        range="[1, inf)",
    ),
    _f(
        "data",
        "--micro-batch-size-sample",
        "int",
        None,
        "2D tile: samples per DiT forward; set with --micro-batch-size-tstep, overrides --micro-batch-size with their product.",
        range="[1, inf)",
    ),
    _f(
        "data",
        "--micro-batch-size-tstep",
        "int",
        None,
        "2D tile: SDE timesteps per DiT forward; set with --micro-batch-size-sample.",
        range="[1, inf)",
    ),
    _f(
        "data",
        "--diffusion-train-iter-order",
        "str",
        "sample_major",
        "Tile visit order; only meaningful with the 2D micro-batch pair.",
        choices=("sample_major", "timestep_major"),
    ),
    _f(
        "data",
        "--train-dp-split-mode",
        "str",
        "contiguous",
        "How samples are split across data-parallel ranks: contiguous lets a micro-batch reproduce a rollout microgroup exactly, stride deals round-robin.",
        choices=("contiguous", "stride"),
    ),
    _f(
        "data",
        "--num-rollout",
        "int",
        None,
        "Total rollout iterations; required unless --num-epoch is given (then derived from the dataset size).",
        range="[1, inf)",
    ),
    _f(
        "data",
        "--num-epoch",
        "int",
        None,
        "Epochs over the dataset; alternative to --num-rollout, ignored if both are set.",
        range="[1, inf)",
    ),
    _f("data", "--start-rollout-id", "int", None, "First rollout id; resumed from --load when unset.", range="[0, inf)"),
    _f("data", "--sft-encoder-checkpoint", "str", None, "SFT only: source of the tokenizer, text encoder and VAE."),
    _f(
        "data",
        "--sft-frame-stride",
        "int",
        1,
        "SFT only: temporal stride when reading a video row: frames 0, k, 2k, ... (--diffusion-output-num-frames of them).",
        range="[1, inf)",
    ),
    _f(
        "data",
        "--sft-image-key",
        "str",
        "image",
        "SFT only: key of each --prompt-data row holding an image path, relative to the JSONL file's folder.",
        metavar="KEY",
        reference_default="(no such flag)",
        differs="The reference reads SFT data through its own data source; here SFT rows are plain JSONL next to their images.",
    ),
    _f(
        "data",
        "--sft-video-key",
        "str",
        "video",
        "SFT only: key of each --prompt-data row holding a video path (a row gives an image or a video), relative to the "
        "JSONL file's folder.",
        metavar="KEY",
        reference_default="(no such flag)",
        differs="The reference reads SFT data through its own data source; here SFT rows are plain JSONL next to their videos.",
    ),
    _f(
        "data",
        "--sft-audio-key",
        "str",
        "audio",
        "SFT only: key of each --prompt-data row holding a WAV file path, for a family that denoises audio with its video "
        "(ltx); relative to the JSONL file's folder.",
        metavar="KEY",
        reference_default="(no such flag)",
        differs="The reference reads SFT data through its own data source; here SFT rows are plain JSONL next to their files.",
    ),
    # ------------------------------------------------------------------ evaluation
    _f("evaluation", "--eval-interval", "int", None, "Evaluate every N rollouts; requires configured eval datasets.", range="[1, inf)"),
    _f("evaluation", "--eval-prompt-data", "str", None, "Eval datasets as repeated NAME PATH pairs.", nargs="+"),
    _f(
        "evaluation",
        "--eval-config",
        "str",
        None,
        "OmegaConf YAML/JSON eval configuration; overrides --eval-prompt-data (set both: a warning says so). Format: "
        "eval: {defaults: {...}, datasets: [{name, path, ...}]}; a dataset may set n_samples_per_eval_prompt, input_key, "
        "image_key, metadata_key, rm_type (its rows' reward), metadata_overrides (merged into every row's metadata) and "
        "diffusion_eval_num_steps; a dataset's value wins over eval.defaults, which wins over the flag. A relative path "
        'resolves against the file\'s folder. Metrics: eval/<name>/...; see docs/guide.md, "Evaluation config file".',
    ),
    _hook("evaluation", "--eval-function-path", "Eval rollout function; defaults to --rollout-function-path."),
    _f("evaluation", "--eval-input-key", "str", None, "Prompt key in eval data rows; defaults to --input-key."),
    _f("evaluation", "--n-samples-per-eval-prompt", "int", 1, "Samples per eval prompt.", range="[1, inf)"),
    _f(
        "evaluation",
        "--diffusion-eval-num-steps",
        "int",
        None,
        "Denoising steps for eval samples; defaults to --diffusion-num-steps.",
        range="[1, inf)",
    ),
    _f("evaluation", "--skip-eval-before-train", "bool", False, "Skip the evaluation before the first training step."),
    _f("evaluation", "--eval-reward-key", "str", None, "Reward key for eval when the reward is a dict; defaults to --reward-key."),
    _f(
        "evaluation",
        "--eval-rm-type",
        "str",
        None,
        "Not in the reference. The evaluations' own reward (a held-out reward watches for reward hacking); unset: the training reward.",
        registry="reward",
        reference_default="(no such flag)",
        differs="Added: the reference evaluates with the training reward (and its --eval-reward-key).",
    ),
    _f(
        "evaluation",
        "--eval-reward-weights",
        "json",
        None,
        "Not in the reference. The evaluations' own weighted mixture of registered rewards (JSON, like "
        "--reward-weights); unset: the training reward.",
        metavar="JSON",
        reference_default="(no such flag)",
        differs="Added with --eval-rm-type: a separate reward set for the evaluations.",
    ),
    # ------------------------------------------------------------------ reward-hacking guard
    _f(
        "guard",
        "--no-guard",
        "bool",
        False,
        "Not in the reference. Turn the reward-hacking guard off (it runs at every evaluation whenever evaluations run; "
        'docs/guide.md, "Reward-hacking guard").',
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    _f(
        "guard",
        "--guard-threshold",
        "float",
        GUARD_THRESHOLD,
        "Not in the reference. The guard's alarm threshold, in units of a statistic's spread at the first evaluation "
        "(the std of its per-sample values): image statistics alarm beyond it either way, diversity below minus it, the "
        "reward gap above it, the judge reward below minus it while the trained reward rose.",
        range="(0, inf)",
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    _f(
        "guard",
        "--guard-thresholds",
        "str",
        None,
        "Not in the reference. Per-statistic thresholds overriding --guard-threshold, as STAT=X items (brightness, "
        "saturation, contrast, high_frequency, jpeg_size, color_entropy, diversity, reward_gap, judge_reward).",
        nargs="+",
        metavar="STAT=X",
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    _f(
        "guard",
        "--guard-kl-max",
        "float",
        GUARD_KL_MAX,
        "Not in the reference. The guard's absolute bound on the KL to the reference (Flow-GRPO's KL term, measured on "
        "transitions of the latest rollout): it is 0 at the first evaluation, so it has no spread to measure drift in.",
        range="(0, inf)",
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    _f(
        "guard",
        "--guard-rm-type",
        "str",
        None,
        "Not in the reference. A judge reward (any registered reward) the guard scores the evaluation samples with: an "
        "alarm when it falls while the trained reward rises.",
        registry="reward",
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    _f(
        "guard",
        "--guard-stop-on-alarm",
        "bool",
        False,
        "Not in the reference. Stop the run at the first guard alarm (exit status 3), after its record is written and a "
        "checkpoint saved (to --save, else RUN_DIR/guard_checkpoint); the final weights are written too.",
        reference_default="(no such flag)",
        differs=_NO_GUARD,
    ),
    # ------------------------------------------------------------------ algorithm and loss
    _f(
        "algorithm",
        "--loss-type",
        "str",
        "policy_loss",
        "Training loss: policy_loss (Flow-GRPO), nft, sft_loss, custom_loss, or a plugin's.",
        registry="loss",
    ),
    _f("algorithm", "--advantage-estimator", "str", "grpo", "Advantage estimator; grpo is the only value today.", choices=("grpo",)),
    _f(
        "algorithm",
        "--disable-grpo-std-normalization",
        "bool",
        False,
        "Do not divide advantages by the reward std (Dr.GRPO); also forced off when --n-samples-per-prompt is 1.",
    ),
    _f(
        "algorithm",
        "--globalize-reward-mean",
        "bool",
        False,
        "Use the batch-wide reward mean instead of the per-prompt mean; leave off for flow_grpo parity.",
    ),
    _f(
        "algorithm",
        "--globalize-reward-std",
        "bool",
        False,
        "Use the batch-wide reward std instead of the per-group std; on in flow_grpo's PickScore recipe.",
    ),
    _f("algorithm", "--diffusion-clip-range", "float", 1e-4, "PPO ratio clip range.", range="(0, inf)"),
    _f(
        "algorithm",
        "--diffusion-adv-clip-max",
        "float",
        5.0,
        "Advantage clamp; under nft it also sets the advantage-to-r slope.",
        range="(0, inf)",
    ),
    _f(
        "algorithm",
        "--diffusion-recompute-old-log-prob",
        "bool",
        False,
        "Recompute old log-probs with the trainer forward instead of trusting the rollout's; policy_loss only.",
    ),
    _f(
        "algorithm",
        "--diffusion-kl-beta",
        "float",
        0.0,
        "Reference-KL coefficient; > 0 turns on a reference forward, 0 disables it.",
        range="[0, inf)",
    ),
    _f(
        "algorithm",
        "--kl-space",
        "str",
        None,
        "Not in the reference. Where the --diffusion-kl-beta term compares the policy with the reference: latent (Flow-GRPO: the step means, "
        "mean((mu - mu_ref)^2) / (2 s^2)) or velocity (mean((v - v_ref)^2), DiffusionNFT's); unset: velocity under losses "
        "that train without SDE transitions (nft), latent otherwise.",
        choices=("latent", "velocity"),
        reference_default="(no such flag)",
        differs="Added: the reference's KL is in latent space only (and nft has none).",
    ),
    _f(
        "algorithm",
        "--ref-mode",
        "str",
        None,
        "Reference policy for KL (and DPO's log-ratios); unset picks ema under nft (its old policy), else lora_base with LoRA.",
        choices=("none", "lora_base", "ema"),
    ),
    _hook("algorithm", "--custom-prepare-train-batch-path", "Builds the DiT inputs from a train batch."),
    _hook("algorithm", "--custom-loss-function-path", "Loss formula for custom_loss; the DiT forward stays in the actor."),
    _f("algorithm", "--diffusion-nft-beta", "float", 1.0, "NFT beta.", range="(0, inf)"),
    _f("algorithm", "--diffusion-nft-timestep-fraction", "float", 0.99, "NFT: fraction of timesteps trained on.", range="(0, 1]"),
    _f("algorithm", "--no-diffusion-nft-adaptive-weight", "bool", False, "NFT: turn off the adaptive loss weight."),
    _f("algorithm", "--no-diffusion-nft-shuffle-timesteps", "bool", False, "NFT: turn off timestep shuffling."),
    # ------------------------------------------------------------------ reward
    _f(
        "reward",
        "--rm-type",
        "str",
        None,
        "Reward model (e.g. pickscore, ocr from the rewards plugin); overridable per sample via metadata.rm_type.",
        registry="reward",
    ),
    _f(
        "reward",
        "--reward-key",
        "str",
        None,
        "Key of the scalar to train on when the reward is a dict (one dict per sample); the other keys are reported as reward components.",
    ),
    _f(
        "reward",
        "--group-rm",
        "bool",
        False,
        "Score a whole prompt group at once: a registered reward gets one call per group, --custom-rm-path gets "
        "rm(args, group_samples) per group.",
    ),
    _hook(
        "reward", "--custom-rm-path", "Custom reward: async def rm(args, samples) -> list[float]; batched only.", path_kind="async_callable"
    ),
    # Not in the reference: a weighted mixture of registered rewards.
    _f(
        "reward",
        "--reward-weights",
        "json",
        None,
        "Not in the reference. A weighted mixture of registered rewards as a JSON object, "
        '\'{"ocr": 0.5, "pickscore": 0.5}\' (or the same mapping under reward_weights in YAML); each reward is '
        "reported as a component. Replaces --rm-type and --custom-rm-path.",
        metavar="JSON",
        reference_default="(no such flag)",
        differs="Added: the reference trains on one reward model; a mixture also reports each component.",
    ),
    _f(
        "reward",
        "--reward-aggregation",
        "str",
        "sum",
        "Not in the reference. How a --reward-weights mixture becomes advantages: sum (GRPO on the weighted sum of "
        "the raw rewards) or advantage (each reward normalised within its prompt group first, then summed with the "
        "weights, so one reward's scale cannot drown another).",
        choices=("sum", "advantage"),
        reference_default="(no such flag)",
        differs="Added with --reward-weights (per-reward advantage aggregation).",
    ),
    _hook("reward", "--custom-reward-post-process-path", "Replaces the advantage normalisation of rewards."),
    _f(
        "reward",
        "--no-streaming-reward",
        "bool",
        False,
        "Not in the reference. Score the rollout after all of it is generated, instead of each microgroup (each "
        "prompt group with --group-rm) as soon as it returns while the rest is still generating.",
        reference_default="(no such flag)",
        differs="Added: rewards stream by default; this turns streaming off (for a reward that must not run while "
        "the engine generates, or to measure what streaming saves).",
    ),
    _f(
        "reward",
        "--colocate-reward",
        "bool",
        False,
        "Place the reward workers on the rollout GPUs (train 0.7 + rollout 0.25 + reward 0.05); requires --colocate.",
    ),
    _f(
        "reward",
        "--reward-num-workers",
        "int",
        1,
        "Not in the reference. Reward workers under --use-ray, each a serve-reward --run-worker process that a Ray "
        "actor starts on a bundle of its own: every scoring "
        "call is split into contiguous chunks (whole prompt groups under --group-rm), one per worker, and the "
        "rewards and metrics are those of one worker. With --colocate-reward, one per rollout device at most. "
        "The miles-rewards plugin's --pickscore-num-workers is another name for it.",
        range="[1, inf)",
        reference_default="(no such flag)",
        differs="Added: the reference sizes only PickScore's workers (--pickscore-num-workers); here every reward "
        "(model, mixture or --custom-rm-path) runs on the workers.",
    ),
    _f(
        "reward",
        "--reward-num-gpus-per-worker",
        "float",
        None,
        "Not in the reference. GPUs per reward worker under --use-ray on a GPU cluster: its bundle is "
        '{"GPU": G, "CPU": 1}, fractions below 1 share a GPU, above 1 a whole number; 0 gives a {"CPU": 1} '
        "bundle (the reward on the CPU). Unset: 1 when a reward in use runs a model (its RewardSpec says "
        "uses_gpu: pickscore, aesthetic), else 0. Not with --colocate-reward (a 0.05 share of a rollout device). "
        "The miles-rewards plugin's --pickscore-num-gpus-per-worker is another name for it.",
        range="[0, inf)",
        reference_default="(no such flag)",
        differs="Added: the reference gives GPUs only to PickScore's workers (--pickscore-num-gpus-per-worker, "
        "default 1); here a weight-free reward keeps its worker off the GPUs.",
    ),
    _f(
        "reward",
        "--rollout-parser-num-workers",
        "int",
        1,
        "Threads decoding rollout responses (msgpack + safetensors) off the event loop, for --rollout-engine "
        "http (Ray actors in the reference); raise it when trajectory tensors are large.",
        range="[1, inf)",
    ),
    # Not in the reference: rewards scored by servers (docs/rewards.md, "Rewards as a service").
    _f(
        "reward",
        "--rm-url",
        "str",
        None,
        "Not in the reference. With --rm-type remote: the base URLs of miles-core serve-reward servers (or any "
        "server speaking the reward wire); batches go to them in turn, and a retried batch goes to the next one.",
        nargs="+",
        metavar="URL",
        reference_default="(no such flag)",
        differs="Added: the reference scores remote rewards only through a function the user writes.",
    ),
    _f(
        "reward",
        "--rm-remote-reward",
        "str",
        None,
        "Not in the reference. With --rm-type remote: the reward the servers must serve (as their /info names "
        "it: pickscore, or a mixture such as '0.5*ocr + 0.5*pickscore'); a server serving another is refused at "
        "start-up and the run exits 2. Unset: any, but every --rm-url must serve the same reward and weights.",
        metavar="NAME",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-pixel-encoding",
        "str",
        "png",
        "Not in the reference. How --rm-type remote sends outputs: png (8-bit RGB per frame, "
        "round(clamp(x, 0, 1) * 255): lossless for every reward that reads 8-bit images) or float32 (the exact "
        "pixels, about 4x the bytes: for rewards that read float pixels).",
        choices=("png", "float32"),
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-batch-size",
        "int",
        8,
        "Not in the reference. Samples per request of --rm-type remote.",
        range="[1, inf)",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-max-in-flight",
        "int",
        4,
        "Not in the reference. Requests of --rm-type remote (vlm_judge: of the judge) waiting for an answer at once, over all URLs.",
        range="[1, inf)",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-timeout",
        "float",
        60.0,
        "Not in the reference. Seconds one request of a reward server (--rm-type remote, vlm_judge) may take; a "
        "request past it is retried. Also how long --rm-type remote waits at start-up for a server still loading its reward.",
        range="(0, inf)",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-max-retries",
        "int",
        3,
        "Not in the reference. Further attempts of a reward-server request that failed in transport, timed out "
        "or was answered 408, 429, 500, 502, 503 or 504 (each on the next --rm-url); a request that still fails masks its "
        "samples, counted in rollout/reward/<reward>_failed.",
        range="[0, inf)",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    _f(
        "reward",
        "--rm-retry-backoff",
        "float",
        0.5,
        "Not in the reference. Seconds before the first retry of a reward-server request, doubled before each "
        "further one (at most 30 s); a 429 or 503 answer's Retry-After, in seconds, replaces it.",
        range="[0, inf)",
        reference_default="(no such flag)",
        differs="Added with --rm-type remote.",
    ),
    # ------------------------------------------------------------------ rollout customization hooks
    _hook("customization", "--custom-generate-function-path", "Replaces the inner generate call of the diffusion rollout."),
    # The filter flags take a registered filter name or a dotted path (checked by the core's miles_validate_config).
    _f(
        "customization",
        "--dynamic-sampling-filter-path",
        "str",
        None,
        "Per-group keep/drop filter (DAPO-style): a registered group filter (check_reward_nonzero_std) or fn(args, "
        "group_samples) -> bool; dropped groups are not trained on and not refilled.",
        metavar="NAME|MODULE.ATTR",
    ),
    _f(
        "customization",
        "--rollout-sample-filter-path",
        "str",
        None,
        "Per-sample loss mask: a registered sample filter or fn(args, groups) -> None that sets sample.remove_sample = "
        "True; removed samples still count for advantage normalisation.",
        metavar="NAME|MODULE.ATTR",
    ),
    _f(
        "customization",
        "--buffer-filter-path",
        "str",
        None,
        "Which kept groups are trained on, in order: a registered buffer filter (pop_first) or fn(args, rollout_id, "
        "groups, num_groups) -> groups.",
        metavar="NAME|MODULE.ATTR",
    ),
    _hook("customization", "--custom-convert-samples-to-train-data-path", "Replaces the whole samples-to-train-data conversion."),
    _hook("customization", "--custom-expand-samples-to-train-pairs-path", "Replaces just the sample-to-train-pair expansion."),
    _hook("customization", "--custom-rollout-log-function-path", "Replaces train rollout logging."),
    _hook("customization", "--custom-eval-rollout-log-function-path", "Replaces eval rollout logging."),
    # ------------------------------------------------------------------ lora
    _f("lora", "--use-lora", "bool", False, "Train LoRA adapters instead of the full model."),
    _f("lora", "--lora-rank", "int", 64, "LoRA rank.", range="[1, inf)"),
    _f("lora", "--lora-alpha", "int", 64, "LoRA alpha.", range="[1, inf)"),
    _f("lora", "--lora-target-modules", "str", None, "Modules to attach LoRA to; defaults per model family.", nargs="+"),
    _f(
        "lora",
        "--lora-init-weights",
        "str",
        "gaussian",
        "LoRA initialisation; kaiming-uniform maps to PEFT's default, other PEFT schemes pass through.",
    ),
    _f(
        "lora", "--lora-ipc-weight-sync", "bool", False, "Push only lora_A/lora_B to the engine, which merges locally; requires --use-lora."
    ),
    # ------------------------------------------------------------------ ema
    _f(
        "ema",
        "--use-ema",
        "bool",
        False,
        "Maintain an EMA copy of the weights as the old policy; needs a consumer (--ref-mode ema or --ema-rollout-policy ema).",
    ),
    _f(
        "ema",
        "--ema-rollout-policy",
        "str",
        "live",
        "Which weights the rollout engine samples with: live or ema (the embedded engine gets the EMA swapped into the shared "
        "modules for each rollout and evaluation; a remote engine is synced the EMA weights).",
        choices=("live", "ema"),
    ),
    _f("ema", "--ema-decay-init", "float", 0.001, "EMA decay during the flat period.", range="[0, 1]"),
    _f(
        "ema",
        "--ema-decay-ramp",
        "float",
        0.001,
        "Per-step EMA decay increase after the flat period (the ramp starts from zero).",
        range="[0, inf)",
    ),
    _f("ema", "--ema-decay-max", "float", 0.5, "Ceiling of the EMA decay.", range="[0, 1]"),
    _f("ema", "--ema-decay-flat-steps", "int", 0, "Steps of constant EMA decay before the ramp.", range="[0, inf)"),
    # ------------------------------------------------------------------ checkpointing
    _f("checkpointing", "--save", "str", None, "Checkpoint directory to save to."),
    _f("checkpointing", "--save-interval", "int", None, "Save every N rollouts; requires --save.", range="[1, inf)"),
    _f(
        "checkpointing",
        "--save-keep-last",
        "int",
        None,
        "Keep only the newest K checkpoints under --save, deleting older ones after each new one is published; never "
        "the one the run resumed from. Unset: keep all.",
        range="[1, inf)",
        metavar="K",
        reference_default="(no such flag)",
        differs="Added: the reference keeps every checkpoint; a sharded full fine-tune's checkpoints are as large as the "
        "model and its optimizer state.",
    ),
    _f("checkpointing", "--no-save-optim", "bool", False, "Do not save optimizer state: smaller checkpoints, but no resumption."),
    _f("checkpointing", "--load", "str", None, "Checkpoint directory to resume from."),
    _f(
        "checkpointing",
        "--ckpt-step",
        "int",
        None,
        "Checkpoint step to load; defaults to latest_checkpointed_iteration.txt.",
        range="[0, inf)",
    ),
    _f("checkpointing", "--no-load-optim", "bool", False, "Do not load optimizer state from the checkpoint."),
    _f(
        "checkpointing",
        "--no-load-rng",
        "bool",
        False,
        "Do not load RNG state from the checkpoint (the global python, numpy and torch generators; the run's own "
        "sampling, step choice and prompt order use seeded generators of their own, so only plugin code drawing from "
        "the global generators notices).",
    ),
    # ------------------------------------------------------------------ logging
    _f(
        "logging",
        "--output-dir",
        "str",
        None,
        "Run directory: metrics.jsonl (one record per rollout), the resolved config.yaml and sample grids; unset: runs/<timestamp>.",
        metavar="DIR",
        reference_default="(no such flag)",
        differs="The reference logs to W&B and its dashboard only; a run here always leaves its metrics and configuration on disk.",
    ),
    _f(
        "logging",
        "--use-wandb",
        "bool",
        False,
        "Log each rollout's record to Weights & Biases (per-step lists as train_step/* series); needs pip install miles-core[wandb].",
    ),
    _f("logging", "--wandb-project", "str", None, "W&B project."),
    _f("logging", "--wandb-group", "str", None, "W&B run group."),
    _f("logging", "--wandb-run-id", "str", None, "W&B run id (to resume a run)."),
    _f("logging", "--wandb-team", "str", None, "W&B team (entity)."),
    _f("logging", "--wandb-host", "str", None, "W&B server host."),
    _f("logging", "--wandb-key", "str", None, "W&B API key."),
    _f("logging", "--wandb-mode", "str", None, "W&B mode; overrides WANDB_MODE.", choices=("online", "offline", "disabled")),
    _f("logging", "--wandb-dir", "str", None, "W&B local directory: runs go to DIR/wandb/; unset: WANDB_DIR, else ./wandb."),
    _f("logging", "--disable-wandb-random-suffix", "bool", False, "Do not append the random suffix W&B run names get by default."),
    _f(
        "logging",
        "--wandb-log-num-images",
        "int",
        0,
        "Images/videos logged per rollout (the first N samples, captioned with prompt and reward; videos as MP4 with the video "
        "extra, else GIFs); 0 disables.",
        range="[0, inf)",
    ),
    _f("logging", "--wandb-log-image-interval", "int", 1, "Send media every N rollouts.", range="[1, inf)"),
    _f(
        "logging",
        "--use-tensorboard",
        "bool",
        False,
        "Write TensorBoard event files: each record's scalars (per-step lists as train_step/* series), each evaluation's "
        "captioned grid, samples and videos (animated GIFs); needs pip install miles-core[tensorboard].",
        reference_default="(no such flag)",
        differs="Added: the reference logs to W&B only; TensorBoard needs no account and no server.",
    ),
    _f(
        "logging",
        "--tensorboard-dir",
        "str",
        None,
        "Where --use-tensorboard writes its event files; unset: RUN_DIR/tensorboard.",
        metavar="DIR",
        reference_default="(no such flag)",
        differs="Added with --use-tensorboard.",
    ),
    _f(
        "logging",
        "--log-level",
        "str",
        "info",
        "What the console and RUN_DIR/train.log show: debug (everything, with the libraries' debug records), info (the "
        "run's lines, hub downloads and load warnings; the default), warning (warnings and errors only: no per-rollout "
        "lines), error (errors only). Tracebacks need --debug before the command.",
        choices=("debug", "info", "warning", "error"),
        reference_default="(no such flag)",
        differs="Added: the reference has no run log file and no level.",
    ),
    _f("logging", "--use-miles-dashboard", "bool", False, "Async phase/trajectory telemetry to the miles dashboard."),
    _f("logging", "--miles-dashboard-workspace", "str", "./miles_dashboard", "miles dashboard workspace directory."),
    # ------------------------------------------------------------------ fault tolerance
    _f(
        "fault_tolerance",
        "--use-fault-tolerance",
        "bool",
        False,
        "Health-check the http or sglang engine's servers; a dead or hung one is restarted (when the run started it) and re-synced "
        "before it serves again, and its requests are retried on another with the same seeds.",
    ),
    _f(
        "fault_tolerance",
        "--rollout-health-check-interval",
        "float",
        30.0,
        "Seconds between engine health checks; raise it for video models, where a request can take minutes.",
        range="(0, inf)",
    ),
    _f(
        "fault_tolerance",
        "--rollout-health-check-timeout",
        "float",
        30.0,
        "Seconds before an engine health check (GET /health) fails.",
        range="(0, inf)",
    ),
    _f(
        "fault_tolerance",
        "--rollout-health-check-first-wait",
        "float",
        0.0,
        "Grace period in seconds before the first health check (compilation/init).",
        range="[0, inf)",
    ),
    # ------------------------------------------------------------------ debugging
    _f("debugging", "--debug-rollout-only", "bool", False, "Rollout only, no training."),
    _f(
        "debugging",
        "--train-only",
        "bool",
        False,
        "Training only: no engines, no weight sync, no eval. RL runs need --load-debug-rollout-data (which implies it).",
        aliases=("--debug-train-only",),
    ),
    _f(
        "debugging",
        "--debug-skip-optimizer-step",
        "bool",
        False,
        "Skip backward and the optimizer step so weights never drift; measures pure forward divergence from the engine.",
    ),
    _f(
        "debugging",
        "--save-debug-rollout-data",
        "str",
        None,
        "Path template, .format(rollout_id) ({} or {rollout_id}): each rollout's samples, full engine outputs and rewards "
        "(msgpack + safetensors, no pickle).",
    ),
    _f(
        "debugging",
        "--load-debug-rollout-data",
        "str",
        None,
        "Path template of saved rollouts to train on with no engine started (implies --train-only); the saved rewards are "
        "used, advantages recomputed.",
    ),
    _f(
        "debugging",
        "--load-debug-rollout-data-subsample",
        "float",
        None,
        "Fraction of each replayed rollout's prompt groups to keep (whole groups, chosen by --rollout-seed and the rollout id).",
        range="(0, 1]",
    ),
    _f(
        "debugging",
        "--save-debug-train-data",
        "str",
        None,
        "Path template, .format(rollout_id): each rollout's train pairs (advantages, old log-probs, loss masks) and train "
        "metrics (msgpack).",
    ),
    _f(
        "debugging",
        "--dump-details",
        "str",
        None,
        "Directory for the debug dumps: sets --save-debug-rollout-data DIR/rollout_data/{}.msgpack and "
        "--save-debug-train-data DIR/train_data/{}.msgpack unless given.",
    ),
    _f(
        "debugging",
        "--diffusion-debug-mode",
        "bool",
        False,
        "Engine returns per-step debug tensors, enabling the model_output_*_abs_diff metrics.",
    ),
    # ------------------------------------------------------------------ ci
    _f("ci", "--ci-test", "bool", False, "CI run (used by tests/e2e); not for manual runs."),
    _f("ci", "--ci-metric-checker-key", "str", None, "CI: metric the checker asserts on."),
    _f("ci", "--ci-metric-checker-threshold", "float", None, "CI: threshold the checked metric must reach.", range="(-inf, inf)"),
)

HARDWARE_ONLY: dict[str, str] = {
    "--rollout-num-gpus": "reserves GPUs for the rollout engines (and, for train-only SFT, the encoders) apart from the trainer's.",
    "--rollout-num-gpus-per-engine": "gives each engine server the run starts that many devices, all on one node and "
    "only those visible to it (CUDA_VISIBLE_DEVICES): an sglang-diffusion server gets --num-gpus N and splits them "
    "itself (sequence parallelism by default; a --sglang-num-gpus, --sglang-tp-size or --sglang-sp-degree you pass "
    "wins); a serve-engine server (--rollout-engine http or embedded) runs on one device, so above 1 it is refused.",
    "--num-gpus-per-node": "caps the GPUs the job may use per node when engines and trainers are placed.",
    "--colocate": "places the engine servers the run starts on the training devices (trainer 0.7, engine 0.25 of each) "
    "instead of devices of their own, where the two take turns (--offload-train and --offload-rollout, which --colocate "
    "turns on).",
    "--colocate-reward": "places the reward workers on the rollout GPUs next to colocated engines and trainer.",
    "--reward-num-workers": "starts that many reward workers (under --use-ray), serve-reward processes each on a bundle of its own, "
    "and splits every scoring call over them.",
    "--reward-num-gpus-per-worker": "gives each reward worker (under --use-ray) that many GPUs (fractions share one).",
    "--distributed-backend": "chooses the torch.distributed backend of the training ranks' process group.",
    "--distributed-timeout-minutes": "bounds how long the training ranks' collectives may wait.",
    "--dp-replicate-size": "splits the data-parallel ranks into replicas of FSDP2 shard groups (hybrid sharding).",
    "--sequence-parallel-size": "splits each sample's tokens over this many training ranks in the trained transformer's "
    "forward and backward (diffusers' context parallelism: Ulysses all-to-all x ring attention), composed with FSDP2 "
    "data parallelism; the world size is data-parallel size x this.",
    "--ulysses-degree": "sets the Ulysses share of sequence parallelism (0: all of it); the rest, SP / this, is ring "
    "attention, which needs a CUDA attention backend that returns the log-sum-exp (--fsdp-attention-backend "
    "_native_cudnn, _native_flash or flash).",
    "--fsdp-reduce-dtype": "sets the precision of the gradient reduce-scatter across data-parallel ranks.",
    "--fsdp-cpu-offload": "keeps the FSDP2 shards of the trainable components, their gradients and the optimizer state "
    "in CPU memory (FSDP2's CPUOffloadPolicy, pinned), copying each block's shards to the GPU for its forward and backward "
    "and running the optimizer step on the CPU; with several training ranks (one process: --offload-train).",
    "--fsdp-cpu-backend": "names the backend of the training process group's CPU side under --fsdp-cpu-offload: the group "
    "is cpu:<backend>,cuda:nccl, so the collectives over the offloaded CPU tensors (the gradient norm of clipping, "
    "checkpoint gathers) run on it.",
}
"""The documented hardware-only flags: flag -> what it does on the hardware it needs
(several GPUs or ranks). Where that hardware is missing (a single process on a CPU-only
machine), setting one is logged as a note; ``docs/cli.md`` lists them."""

UNAVAILABLE: dict[str, str] = {
    "--rollout-patch-group": "numeric-parity patch groups patch sglang-diffusion's own code, which miles-core does not "
    "modify; --rollout-engine sglang serves the stock server",
    "--use-miles-dashboard": "the miles dashboard is a separate product that miles-core does not ship; "
    "use --use-wandb (offline mode works without a network) and metrics.jsonl",
    "--miles-dashboard-workspace": "the miles dashboard is a separate product that miles-core does not ship",
}
"""Flags accepted for compatibility whose feature is not in this version: flag -> why.
A value other than the default is an error for ``train`` and a warning for ``config``."""

FLAGS: tuple[Flag, ...] = tuple(
    replace(flag, hardware=HARDWARE_ONLY.get(flag.name), unavailable=UNAVAILABLE.get(flag.name)) for flag in _TABLE
)
"""Every reference flag, in ``--help`` group order and the reference's order within a group."""
