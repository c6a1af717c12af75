"""The worker processes from the controller's side: spawning them (and the warm zygote they fork from), knowing a
model's units before they start, watching them until they stop or one fails, and restarting a failed job. Starting
a job (``launch``, ``attach``) is ``control/launch.py``, above the Session these serve."""
