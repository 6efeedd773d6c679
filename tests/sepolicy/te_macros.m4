dnl Stand-ins for the AOSP te_macros and global_macros that sepolicy/ uses (not AOSP's text:
dnl the same names, expanding to the rules the AOSP macros grant for our purposes).
define(`r_dir_perms', `{ open getattr read search ioctl lock }')
define(`r_file_perms', `{ getattr open read ioctl lock map }')
define(`rw_file_perms', `{ getattr open read write ioctl lock append map }')
define(`create_dir_perms', `{ open getattr read search ioctl lock create write add_name remove_name rmdir setattr }')
define(`create_file_perms', `{ getattr open read write ioctl lock append map create unlink rename setattr }')
define(`domain_trans', `allow $1 $2:file { getattr open read execute map };
allow $1 $3:process transition;
allow $3 $2:file { entrypoint open read execute getattr map };')
define(`domain_auto_trans', `domain_trans($1,$2,$3)
type_transition $1 $2:process $3;')
define(`init_daemon_domain', `domain_auto_trans(init, $1_exec, $1)')
define(`binder_use', `allow $1 servicemanager:binder { call transfer };
allow servicemanager $1:binder { call transfer };')
define(`binder_call', `allow $1 $2:binder { call transfer };
allow $2 $1:binder transfer;')
define(`binder_service', `typeattribute $1 binderservicedomain;')
define(`add_service', `allow $1 $2:service_manager { add find };')
