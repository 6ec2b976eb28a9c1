// Registers this family's torch ops (called once, from the family's constructor).
#pragma once

namespace tree_recurrence::ssd {
void register_ops();
}
