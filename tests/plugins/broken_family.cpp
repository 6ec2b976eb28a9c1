// One source, several deliberately broken plugins (selected by BROKEN_MODE), so the registry's
// failure handling is tested through the real loader. No torch: these libraries load fast.
#include <stdexcept>

#include "tree_recurrence/sdk/family.h"

namespace {

class TestFamily final : public tree_recurrence::TreeFamily {
 public:
  TestFamily() {
#if BROKEN_MODE == 4
    throw std::runtime_error("test factory refuses to build");
#endif
  }
  std::vector<tree_recurrence::KernelInfo> kernels() const override { return {{"test_kernel", "cpu", true}}; }
};

}  // namespace

#if BROKEN_MODE == 0 || BROKEN_MODE == 4  // 0: a good plugin; 4: its factory throws
TREE_RECURRENCE_FAMILY(TestFamily, FAMILY_NAME, "1.0.0")
#elif BROKEN_MODE == 1  // wrong ABI version
extern "C" TREE_RECURRENCE_EXPORT const TreeRecurrencePluginInfo* tree_recurrence_plugin_info() {
  static const TreeRecurrencePluginInfo info{TREE_RECURRENCE_ABI_VERSION + 41, sizeof(TreeRecurrencePluginInfo), FAMILY_NAME,
                                             "1.0.0", TREE_RECURRENCE_FINGERPRINT, nullptr};
  return &info;
}
#elif BROKEN_MODE == 2  // wrong fingerprint (another torch)
extern "C" TREE_RECURRENCE_EXPORT const TreeRecurrencePluginInfo* tree_recurrence_plugin_info() {
  static const TreeRecurrencePluginInfo info{
      TREE_RECURRENCE_ABI_VERSION, sizeof(TreeRecurrencePluginInfo), FAMILY_NAME, "1.0.0",
      TreeRecurrenceFingerprint{"0.0.1-other-torch", TREE_RECURRENCE_CXX11_ABI, "", ""},
      &tree_recurrence::detail::create_family<TestFamily>};
  return &info;
}
#elif BROKEN_MODE == 3  // no entry symbol at all
extern "C" TREE_RECURRENCE_EXPORT int tree_recurrence_something_else() { return 0; }
#elif BROKEN_MODE == 5  // a null factory
extern "C" TREE_RECURRENCE_EXPORT const TreeRecurrencePluginInfo* tree_recurrence_plugin_info() {
  static const TreeRecurrencePluginInfo info{TREE_RECURRENCE_ABI_VERSION, sizeof(TreeRecurrencePluginInfo), FAMILY_NAME,
                                             "1.0.0", TREE_RECURRENCE_FINGERPRINT, nullptr};
  return &info;
}
#elif BROKEN_MODE == 6  // a family version other than its manifest's
TREE_RECURRENCE_FAMILY(TestFamily, FAMILY_NAME, "2.0.0")
#endif
