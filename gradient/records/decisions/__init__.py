"""Pure decisions over a job's record: fold (history to Job), project (Job and discovery to Status),
next_steps (what should happen next), the settled predicate and the row check. No I/O, no clock."""
