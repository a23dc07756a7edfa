#include "runtime/gil.h"

#include <Python.h>

namespace hypershard::runtime {

void without_gil(const std::function<void()>& fn) {
  if (!Py_IsInitialized() || !PyGILState_Check()) {
    fn();
    return;
  }
  PyThreadState* state = PyEval_SaveThread();
  struct Restore {
    PyThreadState* state;
    ~Restore() { PyEval_RestoreThread(state); }
  } restore{state};
  fn();
}

}  // namespace hypershard::runtime
