"""Each lesson's exercise checks (see lessons/course.py): cNN_<lesson>.py holds `check_<exercise>(fn)`."""
