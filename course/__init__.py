"""The repository's course harness (not part of the installed `grpo_lab` package).

- `course.notebooks`: find the numbered notebooks and execute one with papermill;
- `course.exercises`: exercise cells and filling in their solutions (`solutions/`);
- `course.goals`: what each notebook must have recorded (`NOTEBOOK_GOALS`).

`python -m course 04 [--with-solutions]` runs one notebook as the tests do.
"""
