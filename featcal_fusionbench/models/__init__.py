"""Where weights live: ``lazy`` (base and experts read block by block from their checkpoints), ``residency`` (a
block on the device while it is used), ``checks`` (models that can be calibrated together), ``task_switch`` (which
task's per-task map a merged model applies while a task pool evaluates that task), ``openclip_convert`` (HF CLIP
vision towers as OpenCLIP ones with the same weights, and back).
"""
