"""Each lesson's exercise solutions (see lessons/course.py). Try the exercise before reading them."""
