"""nbval runs every lesson with its exercises' solutions filled in (lessons/course.py): the notebook kernels
inherit this process's environment."""

import os

os.environ["MINIVLLM_LESSON_SOLUTIONS"] = "1"
