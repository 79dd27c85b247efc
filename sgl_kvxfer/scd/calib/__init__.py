"""SCD's offline side: calibration of a producer / consumers pair into artifacts, and the offline
forwards the quality harness shares. `python -m sgl_kvxfer.scd.calib --help`.

    calibrate   CalibConfig, calibrate(cfg): paired prefills -> Reuse fits -> selection -> Patch
    stages      the stages calibrate runs
    fit, build  streamed joint moments, closed-form Reuse fits (nested ranks)
    aligner     Patch aligner training (early stopping on a held-out split)
    select      the paper's Appendix A layer selection
    forward     LlamaRunner: batched, tap-able forwards over the engine's model code
    methods     consumer prefix caches per method (raw, int8, int4, SCD, DroidSpeak, ...)
    data        calibration text: task-suite splits or JSONL files

The serving runtime (server, scheduler, disagg) imports nothing from here; it uses the codec
(`sgl_kvxfer.scd`: artifacts, codec, identity, rotary).
"""
