// ember::Callback: convenience base for callback plugins, one virtual per hook. Compiled into the
// plugin (header-only), so adding hooks here never changes the engine-facing vtable of ICallback.
#pragma once
#include "ember/callback.h"

namespace ember {

class Callback : public ICallback {
 public:
  void on_hook(Hook hook, ITrainer& t) override {
    switch (hook) {
      case Hook::setup: setup(t); break;
      case Hook::teardown: teardown(t); break;
      case Hook::on_fit_start: on_fit_start(t); break;
      case Hook::on_fit_end: on_fit_end(t); break;
      case Hook::on_sanity_check_start: on_sanity_check_start(t); break;
      case Hook::on_sanity_check_end: on_sanity_check_end(t); break;
      case Hook::on_train_start: on_train_start(t); break;
      case Hook::on_train_end: on_train_end(t); break;
      case Hook::on_train_epoch_start: on_train_epoch_start(t); break;
      case Hook::on_train_epoch_end: on_train_epoch_end(t); break;
      case Hook::on_train_batch_start: on_train_batch_start(t); break;
      case Hook::on_train_batch_end: on_train_batch_end(t); break;
      case Hook::on_validation_start: on_validation_start(t); break;
      case Hook::on_validation_end: on_validation_end(t); break;
      case Hook::on_validation_epoch_start: on_validation_epoch_start(t); break;
      case Hook::on_validation_epoch_end: on_validation_epoch_end(t); break;
      case Hook::on_validation_batch_start: on_validation_batch_start(t); break;
      case Hook::on_validation_batch_end: on_validation_batch_end(t); break;
      case Hook::on_test_start: on_test_start(t); break;
      case Hook::on_test_end: on_test_end(t); break;
      case Hook::on_test_epoch_start: on_test_epoch_start(t); break;
      case Hook::on_test_epoch_end: on_test_epoch_end(t); break;
      case Hook::on_test_batch_start: on_test_batch_start(t); break;
      case Hook::on_test_batch_end: on_test_batch_end(t); break;
      case Hook::on_before_backward: on_before_backward(t); break;
      case Hook::on_after_backward: on_after_backward(t); break;
      case Hook::on_before_optimizer_step: on_before_optimizer_step(t); break;
      case Hook::on_before_zero_grad: on_before_zero_grad(t); break;
      case Hook::on_save_checkpoint: on_save_checkpoint(t); break;
      case Hook::on_load_checkpoint: on_load_checkpoint(t); break;
      case Hook::on_exception: on_exception(t); break;
      default: break;  // a hook newer than this header: ignore
    }
  }

  virtual void setup(ITrainer&) {}
  virtual void teardown(ITrainer&) {}
  virtual void on_fit_start(ITrainer&) {}
  virtual void on_fit_end(ITrainer&) {}
  virtual void on_sanity_check_start(ITrainer&) {}
  virtual void on_sanity_check_end(ITrainer&) {}
  virtual void on_train_start(ITrainer&) {}
  virtual void on_train_end(ITrainer&) {}
  virtual void on_train_epoch_start(ITrainer&) {}
  virtual void on_train_epoch_end(ITrainer&) {}
  virtual void on_train_batch_start(ITrainer&) {}
  virtual void on_train_batch_end(ITrainer&) {}
  virtual void on_validation_start(ITrainer&) {}
  virtual void on_validation_end(ITrainer&) {}
  virtual void on_validation_epoch_start(ITrainer&) {}
  virtual void on_validation_epoch_end(ITrainer&) {}
  virtual void on_validation_batch_start(ITrainer&) {}
  virtual void on_validation_batch_end(ITrainer&) {}
  virtual void on_test_start(ITrainer&) {}
  virtual void on_test_end(ITrainer&) {}
  virtual void on_test_epoch_start(ITrainer&) {}
  virtual void on_test_epoch_end(ITrainer&) {}
  virtual void on_test_batch_start(ITrainer&) {}
  virtual void on_test_batch_end(ITrainer&) {}
  virtual void on_before_backward(ITrainer&) {}
  virtual void on_after_backward(ITrainer&) {}
  virtual void on_before_optimizer_step(ITrainer&) {}
  virtual void on_before_zero_grad(ITrainer&) {}
  virtual void on_save_checkpoint(ITrainer&) {}
  virtual void on_load_checkpoint(ITrainer&) {}
  virtual void on_exception(ITrainer&) {}
};

}  // namespace ember
