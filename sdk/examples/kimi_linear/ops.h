// Registers this family's torch ops (called once, from the family's constructor).
#pragma once

namespace kimi_linear {
void register_ops();
}
