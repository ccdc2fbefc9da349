#include "kestrel/autograd/grad_mode.h"

namespace kestrel::autograd {
namespace {
thread_local bool t_grad_enabled = true;
}
bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }
NoGradGuard::NoGradGuard() : saved_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = saved_; }
EnableGradGuard::EnableGradGuard() : saved_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = saved_; }
}  // namespace kestrel::autograd
