"""The repository's course harness (not part of the installed `grpo_lab` package).

- `grpo_lab_course.notebooks`: find the numbered notebooks and execute one with papermill;
- `grpo_lab_course.exercises`: exercise cells and filling in their solutions (`solutions/`);
- `grpo_lab_course.goals`: what each notebook must have recorded (`NOTEBOOK_GOALS`).

`python -m grpo_lab_course 04 [--with-solutions]` runs one notebook as the tests do.
"""
